"""Invariant predicates over observations of a running deployment, named by rule ID.

The model checker calls them at the moment the observation is made (a READY delivered, a
slot about to be overwritten, a read about to write, a request agreed, the network
drained); trace validation calls them on events replayed from real runs. Each raises
``InvariantViolation`` naming the rule, so a counterexample says which rule broke.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from sfa_rd2h.spec.invariants import BY_ID

_F = TypeVar("_F", bound=Callable[..., None])

#: rule ID -> names of the predicates in this module that judge it
PREDICATES: dict[str, list[str]] = {}


def judges(*rule_ids: str) -> Callable[[_F], _F]:
    """Register a predicate against the catalog's rule IDs (an unknown ID fails at import)."""

    def register(fn: _F) -> _F:
        for rule_id in rule_ids:
            if rule_id not in BY_ID:
                raise KeyError(f"{fn.__name__} judges unknown rule {rule_id!r}")
            PREDICATES.setdefault(rule_id, []).append(fn.__name__)
        return fn

    return register


class InvariantViolation(AssertionError):
    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        super().__init__(f"{rule} violated: {message}")


def _fail(rule: str, message: str) -> None:
    raise InvariantViolation(rule, message)


@judges("W1")
def check_w1_meta_before_ready(meta_seen: bool, connection: str, layer_idx: int) -> None:
    """W1: a READY is only ever delivered on a connection that already carried MF_META."""
    if not meta_seen:
        _fail("W1", f"READY for layer {layer_idx} delivered on {connection} before MF_META")


@judges("W1")
def check_w1_no_read_without_meta(who: str, layer_idx: int) -> None:
    """W1 on Decode: a READY that arrived on a connection without an accepted MF_META is
    never read, whatever other connections said."""
    _fail("W1", f"{who} planned a read for layer {layer_idx} on a connection without MF_META")


@judges("W1", "F3")
def check_meta_answered(replies: int, connection: str) -> None:
    """W1/F3: every MF_META gets exactly one answer; a refusal is never silence."""
    if replies != 1:
        _fail("W1", f"{connection}: MF_META answered {replies} times, expected once")


@judges("C4")
def check_c4_ready_after_landed(landed: bool, who: str, layer_idx: int) -> None:
    """C4: Prefill publishes a layer only after its scatter landed."""
    if not landed:
        _fail("C4", f"{who} sent READY for layer {layer_idx} before its KV scatter landed")


@judges("S1", "S5")
def check_s1_no_overwrite_while_read(readers: Mapping[tuple[str, int], int], who: str,
                                     slot: int, layer_idx: int) -> None:
    """S1/S5: a physical slot is written only when no reader of a previous owner is left."""
    left = sorted(k for k, n in readers.items() if n > 0)
    if left:
        desc = ", ".join(f"{ep} (layer {layer})" for ep, layer in left)
        _fail("S1", f"{who} overwrites slot {slot} with layer {layer_idx} while {desc} "
                    "has not replied")


@judges("S6")
def check_s6_no_torn_read(accepted: bool, who: str, session: str) -> None:
    """S6: a read whose source bytes changed while it was in flight is never answered
    READ_DONE."""
    if accepted:
        _fail("S6", f"{who} was answered READ_DONE although {session} rewrote its source "
                    "while it was in flight")


@judges("S2")
def check_s2_gates_by_address(layer_gates: Sequence[Sequence[object]],
                              layer_slots: Sequence[int], who: str) -> None:
    """S2: layers that share a physical slot share its gate; different slots never do."""
    first: dict[int, Sequence[object]] = {}
    for layer, (gates, slot) in enumerate(zip(layer_gates, layer_slots, strict=True)):
        seen = first.setdefault(slot, gates)
        if [id(g) for g in seen] != [id(g) for g in gates]:
            _fail("S2", f"{who}: layer {layer} on slot {slot} has its own completion gate")
    owners = [id(g) for gates in first.values() for g in gates]
    if len(owners) != len(set(owners)):
        _fail("S2", f"{who}: two physical slots share one gate")


@judges("S3", "T4")
def check_s3_one_reply_per_ready(readys: int, replies: int, connection: str,
                                 drained: bool) -> None:
    """S3/T4: never more replies than READYs; once drained, exactly one each."""
    if replies > readys or (drained and replies != readys):
        _fail("S3", f"{connection}: {readys} READY but {replies} replies")


@judges("T2")
def check_t2_main_once(member: int, main_blocks_written: int, who: str) -> None:
    """T2: only group member 0 pulls the main KV."""
    if member != 0 and main_blocks_written:
        _fail("T2", f"{who}: member {member} wrote {main_blocks_written} main blocks")


@judges("T5", "T2", "T6")
def check_main_written_once(writes: int, who: str, block: str) -> None:
    """T5/T6: Decode ranks read disjoint parts of the shared main pool, so within one
    layer a main destination block is written by exactly one read."""
    if writes > 1:
        _fail("T5", f"{who}: main destination {block} written {writes} times in one layer")


@judges("C5")
def check_c5_own_prefix_untouched(owners: Iterable[str | None], who: str) -> None:
    """C5: no byte lands in a block of Decode's own local prefix hit."""
    own = sorted({o[1:] for o in owners if o is not None and o.startswith("=")})
    if own:
        _fail("C5", f"{who} writes into the local prefix blocks of {', '.join(own)}")


@judges("R5")
def check_r5_no_write_after_terminal(owners: Iterable[str | None], who: str) -> None:
    """R5: no byte lands in blocks of a request that is terminal (or never registered)."""
    dead = sorted({o or "<free>" for o in owners if o is None or o.startswith("!")})
    if dead:
        _fail("R5", f"{who} writes into blocks of terminated request(s) {', '.join(dead)}")


@judges("R1", "R4")
def check_r1_success_needs_all(ext_req_id: str, who: str, ratios_seen: set[int],
                               finals: set[int]) -> None:
    """R1/R4/T1: success needs one ratio and a final from every member of the group."""
    if len(ratios_seen) != 1:
        _fail("R1", f"{who}: {ext_req_id} succeeded although contributors reported "
                    f"tp_ratio {sorted(ratios_seen)}")
    ratio = next(iter(ratios_seen))
    if finals != set(range(ratio)):
        _fail("R1", f"{who}: {ext_req_id} succeeded with finals from members {sorted(finals)} "
                    f"of a group of {ratio}")


@judges("R2")
def check_r2_ranks_agree(ext_req_id: str, outcomes: Mapping[int, bool]) -> None:
    """R2: every Decode TP rank ends a request in the same terminal state."""
    if len(set(outcomes.values())) > 1:
        _fail("R2", f"{ext_req_id}: Decode ranks disagree: {dict(outcomes)}")


@judges("R3")
def check_r3_independent(gate_states: Iterable[str]) -> None:
    """R3: slot gates settle whatever happened to requests: free, or failed awaiting the
    compute path, once nothing is in flight."""
    stuck = sorted(set(gate_states) - {"free", "failed"})
    if stuck:
        _fail("R3", f"slot gates still {stuck} with nothing in flight")


@judges("R5", "L1", "T3", "F2", "S7")
def check_data(ext_req_id: str, what: str, got: np.ndarray, want: np.ndarray) -> None:
    """R1/L1/C4/F2/S7: a request that succeeded holds exactly the Prefill bytes (a layer
    Decode never read, because Prefill gave up on it, shows here too)."""
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = "size differs" if got.shape != want.shape else \
            f"{int(np.count_nonzero(got != want))} bytes differ"
        _fail("R1", f"{ext_req_id} succeeded but {what}: {bad}")


@judges("S4", "T4")
def check_quiescence(problems: Sequence[str]) -> None:
    """S4/T4/R1 liveness: with the network drained and no timer pending, every gate is open
    or errored, every Prefill rank finished and every request is terminal."""
    if problems:
        _fail("S4", "deadlock: " + "; ".join(problems))
