"""The objects the machines run on, with the guards and effects the tables name.

Each class holds the data one machine instance needs and nothing else. Guards are pure
predicates over that data and the trigger's arguments; effects only update that data.
Because ``transitions`` passes a trigger's arguments to every callback of that trigger,
callbacks accept and ignore the arguments they do not need.

The ``state`` attribute is written only by ``statemachines.engine.Driver``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ReadFailed(Exception):
    """A batched read's non-zero result with the engine's reason for it (F2): what a
    runtime hands ``read_result`` when it knows more than the number."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(eq=False, slots=True)
class SlotGate:
    """prefill_slot model: who wrote the slot last and who still reads it (S1-S5)."""

    key: str
    state: str = ""
    owner: int | None = None
    publication: int = 0
    pending: set[str] = field(default_factory=set)
    readers: frozenset[str] = frozenset()
    error: str | None = None

    # guards
    def no_readers(self, readers: frozenset[str], *_: object) -> bool:
        return not readers

    def is_pending(self, endpoint: str, *_: object) -> bool:
        return endpoint in self.pending

    def others_pending(self, endpoint: str, *_: object) -> bool:
        return bool(self.pending - {endpoint})

    def has_error(self, *_: object) -> bool:
        return self.error is not None

    # effects
    def take_owner(self, layer_idx: int, *_: object) -> None:
        self.owner = layer_idx
        self.error = None

    def expect_readers(self, readers: frozenset[str], *_: object) -> None:
        self.publication += 1
        self.readers = frozenset(readers)
        self.pending = set(readers)

    def take_reply(self, endpoint: str, *_: object) -> None:
        self.pending.discard(endpoint)

    def take_failure(self, endpoint: str, error: str = "", *_: object) -> None:
        self.pending.discard(endpoint)
        if self.error is None:
            self.error = f"layer {self.owner} via {endpoint}: {error}"

    def release_owner(self, *_: object) -> None:
        self.owner = None
        self.readers = frozenset()
        self.error = None

    def snapshot(self) -> tuple:
        return (self.state, self.owner, tuple(sorted(self.pending)), self.error is not None)


@dataclass(eq=False, slots=True)
class LayerRead:
    """decode_layer_read model: one READY and what the Decode core planned for it."""

    key: str
    layer_idx: int
    state: str = ""
    missing: frozenset[str] = frozenset()
    n_reads: int = 0
    error: str | None = None
    #: when the READY arrived and how long after that a read may still count (S6)
    received_at: float = 0.0
    read_budget: float = float("inf")

    def destinations_missing(self, *_: object) -> bool:
        return bool(self.missing)

    def has_reads(self, *_: object) -> bool:
        return self.n_reads > 0

    def result_ok(self, result: int | BaseException, *_: object) -> bool:
        # F2: only an exact 0 is success; a raised engine error or any other value fails.
        return isinstance(result, int) and not isinstance(result, bool) and result == 0

    def within_budget(self, result: object, now: float, *_: object) -> bool:
        # S6: past the budget Prefill may have stopped waiting for this reader (S5) and
        # rewritten the slot during the copy, so the bytes cannot be trusted.
        return now - self.received_at <= self.read_budget

    def record_error(self, error: str, *_: object) -> None:
        self.error = error

    def record_result(self, result: int | BaseException, now: float, *_: object) -> None:
        if isinstance(result, ReadFailed):
            self.error = f"F2: batched read returned {result.code}: {result.reason}"
        elif isinstance(result, BaseException):
            self.error = f"F2: transfer engine raised {type(result).__name__}: {result}"
        elif self.result_ok(result):
            self.error = (f"S6: the read finished {now - self.received_at:.3g}s after its "
                          f"READY arrived, past the read budget of {self.read_budget:g}s; "
                          "Prefill may have reused the slot meanwhile")
        else:
            self.error = f"F2: batched read returned {result}"


@dataclass(eq=False, slots=True)
class RequestStatus:
    """request_status model: the contributors heard from and the failure, if any (R1-R5)."""

    key: str
    state: str = ""
    ratio: int | None = None
    finals: set[int] = field(default_factory=set)
    error: str | None = None

    def ratio_consistent(self, member: int, ratio: int, *_: object) -> bool:
        return (self.ratio is None or self.ratio == ratio) and 0 <= member < ratio

    def already_final(self, member: int, *_: object) -> bool:
        return member in self.finals

    def others_outstanding(self, member: int, ratio: int, *_: object) -> bool:
        return len(self.finals | {member}) < ratio

    def all_ranks_ok(self, all_ok: bool, *_: object) -> bool:
        return all_ok

    def record_final(self, member: int, ratio: int, *_: object) -> None:
        self.finals.add(member)
        self.ratio = ratio

    def record_ratio_conflict(self, member: int, ratio: int, *_: object) -> None:
        self.error = (f"T1: contributor {member} reports tp_ratio={ratio}, "
                      f"request already has tp_ratio={self.ratio}")

    def record_error(self, error: str, *_: object) -> None:
        if self.error is None:
            self.error = error

    def snapshot(self) -> tuple:
        return (self.state, self.ratio, tuple(sorted(self.finals)), self.error is not None)


@dataclass(eq=False, slots=True)
class PeerSession:
    """peer_session model: handshake state of one Decode endpoint (W1, F3)."""

    key: str
    state: str = ""
    error: str | None = None

    def record_error(self, error: str, *_: object) -> None:
        self.error = error


MODEL_CLASSES = {cls.__name__: cls for cls in (SlotGate, LayerRead, RequestStatus, PeerSession)}
