"""Seeded bugs: named defects the checker must find, switched on only here.

Each bug is a subclass of a production core that overrides one hook, so production code
carries no flag that could turn a bug on. The catalog covers seven known failure modes of
RD2H connectors (the bugs whose doc starts "Known failure N"; spec/PROTOCOL.md lists them)
and at least one defect per rule group (S, R, T, L, W, C, F).
A bug that another defence provably masks is listed as ``equivalent`` with the reason;
the checker still runs it, to show it is not killed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sfa_rd2h.spec import wire
from sfa_rd2h.spec.layout import DestLayout, ReadPlan
from sfa_rd2h.spec.params import RemoteDecode
from sfa_rd2h.spec.topology import Cuts, decode_cuts, indexer_share
from sfa_rd2h.statemachines.cores.decode import DecodeCore, DecodeRequest, ServedReady
from sfa_rd2h.statemachines.cores.prefill import PrefillCore, PrefillRequest
from sfa_rd2h.statemachines.models import LayerRead, SlotGate


# ---------------------------------------------------------------- Prefill defects
class AckFromAnyReader(PrefillCore):
    """Known failure 1: replies counted per layer, not per endpoint."""

    def _match_reply(self, endpoint: str, layer_idx: int) -> list[tuple[SlotGate, str]]:
        if not 0 <= layer_idx < len(self._layer_gates):
            return []
        return [(g, endpoint if g.is_pending(endpoint) else min(g.pending))
                for g in self._layer_gates[layer_idx]
                if g.state == "awaiting_replies" and g.owner == layer_idx and g.pending]


class NoRehandshake(PrefillCore):
    """Known failure 2: a restarted Decode keeps the cached session, no new MF_META."""

    def _reset_session(self, ep) -> None:  # type: ignore[no-untyped-def]
        return None


class NotifyBeforeLanded(PrefillCore):
    """Known failure 4: READY is published when the scatter starts, not when it landed."""

    def begin_layer(self, layer_idx: int, now: float) -> list:
        super().begin_layer(layer_idx, now)
        return super().layer_landed(layer_idx, now)

    def layer_landed(self, layer_idx: int, now: float) -> list:
        return []


class CachedTokensKeyError(PrefillCore):
    """Known failure 7: ``remote_cached_tokens`` read with [] instead of a default."""

    def _parse_params(self, params: Mapping) -> RemoteDecode:
        return RemoteDecode(params["remote_host"], params["remote_port"],
                            params["remote_tp_size"], params["remote_cached_tokens"])


class GateByLayerName(PrefillCore):
    """S2: completion gates keyed by layer name, so layers sharing a slot don't wait."""

    def _gate_keys(self, layer_name: str, meta: wire.LayerMeta) -> tuple[str, str | None]:
        return f"main:{layer_name}", (f"indexer:{layer_name}" if meta.has_indexer else None)


class PrefillCutsShares(PrefillCore):
    """T6: Prefill cuts its member's indexer share before sending (the project's pre-interop
    division), so Decode cuts the already-cut list again and indexer blocks go unread."""

    def _entry(self, req: PrefillRequest, start: int, stop: int) -> wire.ReadReq | None:
        lo, hi = indexer_share(start, stop, self.member, self.mapping.ratio)
        if stop == start:
            return None
        return wire.ReadReq(req.ext_req_id, tuple(req.main_ids[start:stop].tolist()),
                            tuple(req.indexer_ids[lo:hi].tolist()), start, lo)


class DropsPartialBlock(PrefillCore):
    """C2: the final chunk leaves out its partial last block."""

    def _chunk_stop(self, computed_tokens: int, final: bool) -> int:
        return computed_tokens // self.block_size


# ---------------------------------------------------------------- Decode defects
class TrustFirstRatio(DecodeCore):
    """Known failure 3: the first tp_ratio seen for a request is trusted."""

    def _ratio_conflict(self, req: DecodeRequest, msg: wire.ReadReadyBatch) -> bool:
        return False

    def _final_signal(self, req: DecodeRequest, msg: wire.ReadReadyBatch) -> tuple[int, int]:
        return msg.group_member_idx, req.ratio or msg.tp_ratio


class EveryMemberPullsMain(DecodeCore):
    """T2: Decode also reads main KV from group members other than 0."""

    def _cuts(self, n_main: np.ndarray, n_indexer: np.ndarray, main_start: np.ndarray,
              indexer_start: np.ndarray, member: int, ratio: int) -> Cuts:
        as_member_0 = super()._cuts(n_main, n_indexer, main_start, indexer_start, 0, ratio)
        own = super()._cuts(n_main, n_indexer, main_start, indexer_start, member, ratio)
        return replace(own, main_lo=as_member_0.main_lo, main_hi=as_member_0.main_hi)


class IndexerGap(DecodeCore):
    """T3: the last member's indexer piece stops one block short, so the union of the
    members' pieces misses a block."""

    def _cuts(self, n_main: np.ndarray, n_indexer: np.ndarray, main_start: np.ndarray,
              indexer_start: np.ndarray, member: int, ratio: int) -> Cuts:
        cuts = super()._cuts(n_main, n_indexer, main_start, indexer_start, member, ratio)
        if member != ratio - 1:
            return cuts
        short = cuts.indexer_hi - (cuts.indexer_hi > cuts.indexer_lo)
        return replace(cuts, indexer_hi=short)


class MainNotShared(DecodeCore):
    """T5: every Decode rank reads the whole main range into the pool the ranks share."""

    def _cuts(self, n_main: np.ndarray, n_indexer: np.ndarray, main_start: np.ndarray,
              indexer_start: np.ndarray, member: int, ratio: int) -> Cuts:
        return decode_cuts(n_main, n_indexer, main_start, indexer_start, member, ratio,
                           self.d_rank, self.d_tp, main_shared=False)


class FailWithoutWaiting(DecodeCore):
    """Known failure 5: a READY before destination registration fails at once."""

    def _await_destinations(self, ready: ServedReady, missing: frozenset[str], now: float) -> list:
        return self._reject(ready, f"C1: no destinations for {sorted(missing)}")


class WriteAfterTerminal(DecodeCore):
    """Known failure 6: a late contributor still writes into a finished request's blocks."""

    def _is_live(self, req: DecodeRequest) -> bool:
        return True

    def _forget(self, ext_req_id: str) -> None:
        return None


class DuplicateFinalAdvances(DecodeCore):
    """R4: each final signal counts as a new contributor."""

    def _final_signal(self, req: DecodeRequest, msg: wire.ReadReadyBatch) -> tuple[int, int]:
        return len(req.status.finals) % msg.tp_ratio, msg.tp_ratio


class TrustSourceLayout(DecodeCore):
    """L1: Decode skips layout validation and addresses destinations with the source's
    block sizes."""

    def _plan_layer(self, src: wire.LayerMeta, dst: DestLayout, live: list[wire.ReadReq],
                    msg: wire.ReadReadyBatch, body: bytes | None = None) -> ReadPlan:
        trusted = DestLayout(dst.base_addrs, src.ext_block_bytes, dst.num_blocks,
                             dst.main_tensor_count, dst.has_indexer, dst.has_scale)
        return super()._plan_layer(src, trusted, live, msg, body)

    def _validate_layout(self, src: wire.LayerMeta, dst: DestLayout) -> None:
        return None


class SilentEmptyLayer(DecodeCore):
    """S3/T4: no reply when the Decode rank had nothing to read for the layer."""

    def _must_reply(self, ready: ServedReady) -> bool:
        return ready.read.n_reads > 0


class EmptyEntryFailsLayer(DecodeCore):
    """T6: an entry with both lists empty fails the whole layer (this project's Decode did
    so once) instead of being skipped as upstream's Decode skips it."""

    def _on_ready(self, peer: str, msg: wire.ReadReadyBatch, now: float,
                  payload: bytes = b"") -> list:
        empty = next((e.ext_req_id for e in msg.read_reqs
                      if not len(e.p_main_block_ids) and not len(e.p_indexer_block_ids)), None)
        if empty is None or peer not in self.connections:
            return super()._on_ready(peer, msg, now, payload)
        read = self._reads.start(LayerRead(self._read_key(peer, msg.layer_idx), msg.layer_idx))
        return self._reject(ServedReady(peer, msg, read, trusted=True),
                            f"T6: entry for {empty!r} carries no block at all")


class FailedReadReportedDone(DecodeCore):
    """F2: a non-zero transfer result is treated as success."""

    def _transfer_result(self, result: int) -> int:
        return 0


class MalformedUnanswered(DecodeCore):
    """W5: a malformed READY whose layer is identifiable gets no READ_FAILED."""

    def _answer_malformed(self, peer: str, payload: bytes, exc) -> list:  # type: ignore[no-untyped-def]
        return []


class NoMetaCheck(DecodeCore):
    """W1: READY accepted on a connection without MF_META, using any other connection's."""

    def _on_ready(self, peer: str, msg: wire.ReadReadyBatch, now: float,
                  payload: bytes = b"") -> list:
        if peer not in self.connections and self.connections:
            self.connections[peer] = next(iter(self.connections.values()))
        return super()._on_ready(peer, msg, now, payload)


class FinalAfterLostLayer(PrefillCore):
    """S7: after giving up on a reader, Prefill still reports the requests of the lost
    READY final to that endpoint, so Decode completes them without that layer."""

    def _abandon(self, endpoint: str, layer_idx: int | None, reason: str) -> None:
        return None


class LateReadAccepted(DecodeCore):
    """S6: a read is accepted however long after its READY it finished, also after Prefill
    gave up on the reader (S5) and rewrote the slot during the copy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_budget = float("inf")


class WritesOwnPrefix(DecodeCore):
    """C5: Decode reads every position a READY names, its own local prefix hit included,
    so an early-dispatched Prefill's blocks overwrite what Decode computed itself."""

    def _own_prefix(self, req: DecodeRequest) -> tuple[int, int]:
        return 0, 0


# ---------------------------------------------------------------- catalog
@dataclass(frozen=True)
class SeededBug:
    name: str
    rules: tuple[str, ...]
    doc: str
    prefill: type[PrefillCore] = PrefillCore
    decode: type[DecodeCore] = DecodeCore
    scope_hint: str = ""  # which scopes expose it (informational)
    equivalent: str = ""  # why another defence masks it, if it does


BUGS: tuple[SeededBug, ...] = (
    SeededBug("ack_from_any_reader", ("S1", "S5"), AckFromAnyReader.__doc__,
              prefill=AckFromAnyReader),
    SeededBug("no_rehandshake_after_restart", ("W1",), NoRehandshake.__doc__,
              prefill=NoRehandshake),
    SeededBug("trust_first_ratio", ("R1", "T1"), TrustFirstRatio.__doc__,
              decode=TrustFirstRatio, scope_hint="legacy contributor"),
    SeededBug("notify_before_landed", ("C4",), NotifyBeforeLanded.__doc__,
              prefill=NotifyBeforeLanded),
    SeededBug("fail_without_waiting", ("C1", "C4"), FailWithoutWaiting.__doc__,
              decode=FailWithoutWaiting),
    SeededBug("write_after_terminal", ("R5",), WriteAfterTerminal.__doc__,
              decode=WriteAfterTerminal),
    SeededBug("cached_tokens_keyerror", ("C1",), CachedTokensKeyError.__doc__,
              prefill=CachedTokensKeyError),
    SeededBug("gate_by_layer_name", ("S2", "S1"), GateByLayerName.__doc__,
              prefill=GateByLayerName),
    SeededBug("silent_empty_layer", ("S3", "T4"), SilentEmptyLayer.__doc__,
              decode=SilentEmptyLayer),
    SeededBug("duplicate_final_advances", ("R4", "R1"), DuplicateFinalAdvances.__doc__,
              decode=DuplicateFinalAdvances),
    SeededBug("every_member_pulls_main", ("T2",), EveryMemberPullsMain.__doc__,
              decode=EveryMemberPullsMain),
    SeededBug("indexer_gap", ("T3",), IndexerGap.__doc__, decode=IndexerGap),
    SeededBug("main_not_shared", ("T5",), MainNotShared.__doc__, decode=MainNotShared),
    SeededBug("prefill_cuts_shares", ("T6", "T3"), PrefillCutsShares.__doc__,
              prefill=PrefillCutsShares),
    SeededBug("trust_source_layout", ("L1",), TrustSourceLayout.__doc__,
              decode=TrustSourceLayout, scope_hint="layout mismatch"),
    SeededBug("malformed_unanswered", ("W5", "S3"), MalformedUnanswered.__doc__,
              decode=MalformedUnanswered),
    SeededBug("no_meta_check", ("W1",), NoMetaCheck.__doc__, decode=NoMetaCheck,
              scope_hint="rogue peer"),
    SeededBug("drops_partial_block", ("C2",), DropsPartialBlock.__doc__,
              prefill=DropsPartialBlock),
    SeededBug("failed_read_reported_done", ("F2", "R5"), FailedReadReportedDone.__doc__,
              decode=FailedReadReportedDone),
    SeededBug("late_read_accepted", ("S6", "S5"), LateReadAccepted.__doc__,
              decode=LateReadAccepted, scope_hint="slow reader"),
    SeededBug("final_after_lost_layer", ("S7", "R1"), FinalAfterLostLayer.__doc__,
              prefill=FinalAfterLostLayer, scope_hint="slow reader or restart"),
    SeededBug("empty_entry_fails_layer", ("T6",), EmptyEntryFailsLayer.__doc__,
              decode=EmptyEntryFailsLayer, scope_hint="zero-block entries"),
    SeededBug("writes_own_prefix", ("C5", "C3"), WritesOwnPrefix.__doc__,
              decode=WritesOwnPrefix, scope_hint="early dispatch, cached tokens"),
)

BY_NAME = {b.name: b for b in BUGS}


@dataclass
class MutantOutcome:
    name: str
    rules: tuple[str, ...]
    killed: bool
    seconds: float | None  # to the first failure, before shrinking
    steps: int | None  # operations in the shrunk counterexample, deployment included
    equivalent: str
    counterexample: list[str]
    scope: object = None
    ops: list[tuple] | None = None

    def as_json(self) -> dict:
        return {"name": self.name, "rules": list(self.rules), "killed": self.killed,
                "seconds": None if self.seconds is None else round(self.seconds, 3),
                "steps": self.steps, "equivalent": self.equivalent or None}


def run_mutants(budget: float, seed_value: int = 0, names: list[str] | None = None,
                on_result: Callable[[MutantOutcome], None] | None = None,
                on_start: Callable[[SeededBug], None] | None = None,
                on_progress: Callable[[float, int], None] | None = None,
                on_shrink: Callable[[], None] | None = None,
                ) -> list[MutantOutcome]:
    """Run the checker against every seeded bug, ``budget`` seconds each.

    ``names`` selects bugs; an unknown name raises ``KeyError`` listing the known ones.
    ``on_start`` / ``on_progress`` / ``on_shrink`` / ``on_result`` follow each bug's run
    (for a progress display)."""
    from sfa_rd2h.model_check.checker import run_check

    unknown = sorted(set(names or ()) - set(BY_NAME))
    if unknown:
        raise KeyError(f"unknown seeded bug(s) {', '.join(unknown)}; known: "
                       f"{', '.join(BY_NAME)}")
    outcomes = []
    for bug in BUGS:
        if names and bug.name not in names:
            continue
        if on_start is not None:
            on_start(bug)
        result = run_check(budget, seed_value, prefill_cls=bug.prefill, decode_cls=bug.decode,
                           shrink_seconds=min(20.0, budget), on_progress=on_progress,
                           on_shrink=on_shrink)
        killed = not result.ok
        outcome = MutantOutcome(
            bug.name, bug.rules, killed, result.first_failure if killed else None,
            (len(result.ops) + 1) if killed else None,
            "" if killed else bug.equivalent, result.counterexample, result.scope,
            result.ops if killed else None)
        outcomes.append(outcome)
        if on_result is not None:
            on_result(outcome)
    return outcomes
