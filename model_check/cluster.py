"""A whole Prefill/Decode deployment built from the production cores, for model checking.

The cores are the real ``PrefillCore`` / ``DecodeCore``. Around them this module simulates
only what is outside the protocol: a network that is FIFO per (Prefill rank, Decode rank)
connection in each direction and interleaves arbitrarily across connections (ZMQ over TCP
keeps order per DEALER-ROUTER pair), a transfer engine that copies real bytes between
simulated Prefill and Decode memories all-or-nothing, the Decode scheduler (rendezvous and
late registration), the TP agreement, timers, and faults.

Every state change is an *operation* (a small tuple) from ``enabled()``; ``apply(op)``
performs it and evaluates the invariants of ``model_check.invariants`` at the moment the
relevant observation is made. The hypothesis checker and the exhaustive explorer both
drive this one class.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from sfa_rd2h.model_check import invariants as inv
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.spec.timing import READ_BUDGET_S, REPLY_TIMEOUT_S
from sfa_rd2h.spec.topology import tp_mapping
from sfa_rd2h.statemachines.cores.actions import Disconnect, IssueRead, Send
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import LayerSendError, PrefillCore
from sfa_rd2h.statemachines.trace import Tracer

BLOCK_TOKENS = 4  # tokens per KV block in the model
MAIN_BYTES, INDEXER_BYTES, SCALE_BYTES = 4, 2, 1  # bytes per block of each tensor kind
P_BASE, D_BASE = 0x1000, 0x100000
D_PORT = 7000
FOREVER = 1e9
# S6's assumption: a frame reaches the Decode core within this long of being sent, so time
# never passes that bound while one is in flight.
DELIVERY_BOUND_S = REPLY_TIMEOUT_S - READ_BUDGET_S
# What swarm testing switches on or off per deployment; "rogue" is a peer outside the
# project's Prefill discipline, in either of its two forms; "slow_reader" lets Prefill's reply
# timeout fire while a Decode read is still in flight (FAULT_OPS names every fault op).
FAULT_KINDS = ("fail_read", "dup_reply", "replay_final", "garbage", "restart_decode", "rogue",
               "slow_reader")
FAULT_OPS = ("fail_read", "dup_reply", "replay_final", "garbage", "restart_decode",
             "rogue_ready", "rogue_meta", "p_timeout")

Op = tuple


@dataclass(frozen=True)
class RequestSpec:
    tokens: int  # prompt length; the last block may be partial
    chunks: tuple[int, ...]  # computed tokens after each chunk; the last equals ``tokens``
    # Decode's own local prefix hit; Prefill is told it too (None: the parameter is missing,
    # known failure 7), but 0 when it is dispatched early (C3, C5)
    cached_tokens: int | None = 0
    group: int = -1  # requests of one prompt list share a group (C3); -1 = alone

    @property
    def blocks(self) -> int:
        return -(-self.tokens // BLOCK_TOKENS)


@dataclass(frozen=True)
class Scope:
    p_tp: int = 2
    d_tp: int = 1
    n_layers: int = 2
    n_slots: int = 1
    indexer: bool = True
    scale: bool = False
    requests: tuple[RequestSpec, ...] = (RequestSpec(6, (6,)), RequestSpec(4, (4,)))
    layout_mismatch_layer: int | None = None  # Decode registered another block size (L1)
    legacy_rank: int | None = None  # a Prefill rank running a pre-unequal-TP build (W4, T1)
    # Prefill ranks also send an entry with both lists empty for a chunk that completed no
    # block, as a Prefill outside the project may: Decode must skip it, not fail (T6)
    empty_entries: bool = False
    d_instances: int = 1  # Decode instances; request i goes to instance i % d_instances
    # Swarm testing: each run allows a few fault kinds, which finds bugs that need one
    # kind repeated far sooner than spreading the fault budget over all of them.
    fault_kinds: frozenset[str] = frozenset(FAULT_KINDS)
    max_faults: int = 3  # fault operations allowed in one run; 0 = lossless and on time
    # The proxy dispatches every request to Prefill before its rendezvous, with no cached
    # tokens: Decode must keep its own prefix hit itself (C3, C5)
    early_dispatch: bool = False

    def tensor_bytes(self) -> tuple[int, ...]:
        sizes = [MAIN_BYTES, MAIN_BYTES]
        if self.indexer:
            sizes.append(INDEXER_BYTES)
            if self.scale:
                sizes.append(SCALE_BYTES)
        return tuple(sizes)


def pattern(req: int, layer: int, pos: int, tensor: int, nbytes: int) -> np.ndarray:
    """The bytes Prefill computes for one block: distinct per request, layer and position."""
    seed = (req * 61 + layer * 17 + pos * 7 + tensor * 3 + 1) % 251
    return ((np.arange(nbytes, dtype=np.int64) * 13 + seed) % 255 + 1).astype(np.uint8)


class LegacyPrefillCore(PrefillCore):
    """A Prefill rank built before unequal TP: 5-field READY (W4), so Decode takes it for
    member 0 of a group of one (the mixed-build hazard of T1)."""

    def _encode_ready(self, frames, layer_idx, layer_name, done):  # type: ignore[no-untyped-def]
        fields = msgpack.unpackb(super()._encode_ready(frames, layer_idx, layer_name, done),
                                 raw=False)
        return msgpack.packb(fields[:5], use_bin_type=True)


class _EmptyEntries:
    """Mixed into a Prefill core: a chunk that completed no block still gets an entry,
    with both lists empty, in every READY of its step (upstream's Prefill never sends one,
    upstream's Decode skips one; T6)."""

    def _entry(self, req, start, stop):  # type: ignore[no-untyped-def]
        entry = super()._entry(req, start, stop)  # type: ignore[misc]
        return wire.ReadReq(req.ext_req_id, (), (), start, start) if entry is None else entry


@functools.cache
def with_empty_entries(cls: type[PrefillCore]) -> type[PrefillCore]:
    """``cls`` (a seeded bug's core included) sending zero-block entries."""
    return type(f"EmptyEntries{cls.__name__}", (_EmptyEntries, cls), {})


@dataclass
class _Ghost:
    """What the checker knows that no core does: who may still read which slot, which
    requests each rank heard from, who owns each destination block."""

    readers: dict[tuple[int, int], Counter] = field(default_factory=dict)  # (p, slot)
    readys: Counter = field(default_factory=Counter)  # (p, d) -> READYs delivered
    replies: Counter = field(default_factory=Counter)  # (p, d) -> replies sent
    meta_seen: set[tuple[int, int]] = field(default_factory=set)
    read_source: dict = field(default_factory=dict)  # (d, read id) -> source bytes at issue
    ratios: dict[tuple[int, str], set[int]] = field(default_factory=dict)  # (d, ext)
    finals: dict[tuple[int, str], set[int]] = field(default_factory=dict)
    read_origin: dict[tuple[int, int], tuple[int, int, int, bool]] = field(default_factory=dict)
    last_final: dict[tuple[int, int], bytes] = field(default_factory=dict)
    main_writes: Counter = field(default_factory=Counter)  # (instance, layer, tensor, block)
    replays: Counter = field(default_factory=Counter)  # ((p, d), payload) replays in flight
    last_ready: dict[tuple[int, int], bytes] = field(default_factory=dict)
    rogue_replies: Counter = field(default_factory=Counter)  # rogue identity -> replies


class Cluster:
    """One deployment: ``p_tp`` Prefill cores, ``d_tp`` Decode cores, network, memory."""

    def __init__(self, scope: Scope, prefill_cls: type[PrefillCore] = PrefillCore,
                 decode_cls: type[DecodeCore] = DecodeCore,
                 trace_dir: Path | None = None) -> None:
        self.scope = scope
        # With a trace folder every core records its transitions through the runtime's
        # Tracer, so `sfa-rd2h validate` can judge model runs exactly as it judges real ones.
        self.trace_dir = trace_dir
        self.tracers: list[Tracer] = []
        self._trace_of: dict[str, Tracer] = {}
        self._restarts = 0
        # A restarted Decode sees new connections: identities carry the instance's epoch.
        self._epoch = [0] * scope.d_instances
        self.prefill_cls = prefill_cls
        self.decode_cls = decode_cls
        self.mapping = tp_mapping(scope.p_tp, scope.d_tp)
        self.tbytes = scope.tensor_bytes()
        self.n_req = len(scope.requests)
        self.n_d = scope.d_instances * scope.d_tp
        self.ext = [f"req-{i}" for i in range(self.n_req)]
        self.p_blocks = sum(r.blocks for r in scope.requests) + 1
        self.d_blocks = self.p_blocks + 1
        self._layout_prefill()
        self._layout_decode()
        self.prefill = [self._new_prefill(p) for p in range(scope.p_tp)]
        # Decode ranks are numbered globally: g = instance * d_tp + tp_rank.
        self.decode = [self._new_decode(g) for g in range(self.n_d)]
        self.to_d: dict[tuple[int, int], deque[bytes]] = {}
        self.to_d_sent: dict[tuple[int, int], deque[float]] = {}  # when each was sent
        self.to_p: dict[tuple[int, int], deque[bytes]] = {}
        for p in range(scope.p_tp):
            for inst in range(scope.d_instances):
                g = inst * scope.d_tp + self.mapping.d_rank(p)
                self.to_d[(p, g)] = deque()
                self.to_d_sent[(p, g)] = deque()
                self.to_p[(p, g)] = deque()
        self.reads: list[deque[IssueRead]] = [deque() for _ in range(self.n_d)]
        self.schedule = self._schedule()
        self.p_pos = [(0, 0, "begin")] * scope.p_tp  # (step, layer, phase) per Prefill rank
        self.p_started: list[set[int]] = [set() for _ in range(scope.p_tp)]
        self.rendezvous: set[int] = set()
        # requests Decode's vLLM ended before allocating them (early dispatch only: Prefill
        # already has them, C3)
        self.abandoned: set[int] = set()
        self.registered: list[set[int]] = [set() for _ in range(self.n_d)]
        self.lost: set[int] = set()  # requests that died with a Decode restart
        self.outcome: dict[int, bool] = {}
        self.fail_next_read = [False] * self.n_d
        self.faults = 0
        self.timer_fired = False
        self.p_errors = 0
        # One clock for every process: timeouts on both sides measure the same time passing,
        # which is what S6 relies on (each side measures only its own durations).
        self.now = 0.0
        # Prefill's connection to a Decode rank is replaced after a reply timeout (S5): the
        # new DEALER has a new identity, so replies to the old one never reach it.
        self._conn_gen: Counter[tuple[int, int]] = Counter()
        self.ghost = _Ghost()
        # (p, READY, is a replay[, "rogue"]) while Decode handles a delivered READY
        self._ready_in_hand: tuple | None = None
        self._rogues = 0
        self._by_kind: dict[str, list[Op]] | None = None
        # who owns each destination block: main pool per instance, indexer copy per rank
        self.block_owner = [np.full(self.d_blocks, "", dtype=object)
                            for _ in range(scope.d_instances)]
        self.idx_owner = [np.full(self.d_blocks, "", dtype=object) for _ in range(self.n_d)]
        for p, core in enumerate(self.prefill):
            inv.check_s2_gates_by_address(
                [core.gates_of(layer) for layer in range(scope.n_layers)],
                [layer % scope.n_slots for layer in range(scope.n_layers)], f"P{p}")

    # ------------------------------------------------------------------ layout
    def _layout_prefill(self) -> None:
        s = self.scope
        self.p_tensor_base: list[list[int]] = []  # [slot][tensor]
        addr = P_BASE
        for _slot in range(s.n_slots):
            row = []
            for nbytes in self.tbytes:
                row.append(addr)
                addr += self.p_blocks * nbytes
            self.p_tensor_base.append(row)
        self.p_mem = [np.zeros(addr, dtype=np.uint8) for _ in range(s.p_tp)]
        # Non-contiguous, request-disjoint Prefill block ids exercise the coalescing.
        ids = np.arange(self.p_blocks - 1)[::-1]
        self.p_main_ids, self.p_idx_ids = [], []
        start = 0
        for i, r in enumerate(s.requests):
            mine = ids[start:start + r.blocks]
            start += r.blocks
            self.p_main_ids.append(mine if i % 2 else np.sort(mine))
            self.p_idx_ids.append(np.sort(mine))
        self.layer_meta = {}
        for layer in range(s.n_layers):
            base = self.p_tensor_base[layer % s.n_slots]
            n = len(self.tbytes)
            self.layer_meta[f"layer.{layer}"] = wire.LayerMeta(
                tuple(base), self.tbytes, (1,) * n, tuple([0, 0, 1, 1][:n]), 2, s.indexer)

    def _layout_decode(self) -> None:
        s = self.scope
        # start, end, kind, layer, tensor, owner (instance for main, global rank for indexer)
        self.d_regions: list[tuple[int, int, str, int, int, int]] = []
        addr = D_BASE
        self.d_dest: list[dict[str, DestLayout]] = [{} for _ in range(self.n_d)]
        n_t = len(self.tbytes)
        for inst in range(s.d_instances):
            main_base: dict[tuple[int, int], int] = {}
            for layer in range(s.n_layers):
                for t in range(2):
                    nbytes = self._d_bytes(layer, t)
                    main_base[(layer, t)] = addr
                    self.d_regions.append(
                        (addr, addr + self.d_blocks * nbytes, "main", layer, t, inst))
                    addr += self.d_blocks * nbytes
            for g in self.ranks_of(inst):
                for layer in range(s.n_layers):
                    bases = [main_base[(layer, 0)], main_base[(layer, 1)]]
                    for t in range(2, n_t):
                        nbytes = self._d_bytes(layer, t)
                        bases.append(addr)
                        self.d_regions.append(
                            (addr, addr + self.d_blocks * nbytes, "indexer", layer, t, g))
                        addr += self.d_blocks * nbytes
                    self.d_dest[g][f"layer.{layer}"] = DestLayout(
                        tuple(bases), tuple(self._d_bytes(layer, t) for t in range(n_t)),
                        (self.d_blocks,) * n_t, 2, s.indexer, s.indexer and s.scale)
        self.d_mem = np.zeros(addr, dtype=np.uint8)
        self.region_starts = np.array([r[0] for r in self.d_regions], dtype=np.int64)
        # Destination ids: the main pool is shared by an instance's ranks (one list per
        # request); each rank's indexer copy is rank-local (its own list).
        pool = np.arange(1, self.d_blocks)
        self.d_main_ids: list[np.ndarray] = []
        self.d_idx_ids: list[dict[int, np.ndarray]] = []
        start = [0] * s.d_instances
        for i, r in enumerate(s.requests):
            inst = self.instance_of(i)
            lo = start[inst]
            start[inst] += r.blocks
            self.d_main_ids.append(pool[lo:lo + r.blocks])
            self.d_idx_ids.append({g: np.roll(pool, g)[lo:lo + r.blocks]
                                   for g in self.ranks_of(inst)})

    def instance_of(self, i: int) -> int:
        return i % self.scope.d_instances

    def ranks_of(self, inst: int) -> range:
        return range(inst * self.scope.d_tp, (inst + 1) * self.scope.d_tp)

    def _endpoint(self, g: int) -> str:
        return f"d{g // self.scope.d_tp}:{D_PORT + g % self.scope.d_tp}"

    def _rank_of_endpoint(self, endpoint: str) -> int:
        host, port = endpoint.split(":")
        return int(host[1:]) * self.scope.d_tp + int(port) - D_PORT

    def _d_bytes(self, layer: int, tensor: int) -> int:
        nbytes = self.tbytes[tensor]
        if layer == self.scope.layout_mismatch_layer and tensor < 2:
            return nbytes * 2
        return nbytes

    def _tracer(self, name: str, **info: object) -> Tracer | None:
        if self.trace_dir is None:
            return None
        tracer = Tracer(self.trace_dir / f"{name}.jsonl", name, **info)
        self.tracers.append(tracer)
        self._trace_of[name.split(".")[0]] = tracer  # the live process of that rank
        return tracer

    def _trace_msg(self, who: str, direction: str, peer: str, payload: bytes,
                   conn: str | None = None) -> None:
        tracer = self._trace_of.get(who)
        if tracer is not None:
            tracer.message(direction, peer, payload, conn=conn)

    def _identity(self, p: int, g: int) -> str:
        """The ZMQ identity Decode rank ``g`` sees for Prefill rank ``p``'s connection."""
        gen = self._conn_gen[(p, g)]
        return f"p{p}@{self._epoch[g // self.scope.d_tp]}" + (f".{gen}" if gen else "")

    def close_traces(self) -> None:
        for tracer in self.tracers:
            tracer.close()

    def _new_prefill(self, p: int) -> PrefillCore:
        cls = LegacyPrefillCore if p == self.scope.legacy_rank else self.prefill_cls
        if self.scope.empty_entries:
            cls = with_empty_entries(cls)
        return cls(p, self.mapping, f"p{p}:1", self.layer_meta, block_size=BLOCK_TOKENS,
                   observer=self._tracer(f"prefill{p}", role="prefill", rank=p))

    def _new_decode(self, g: int) -> DecodeCore:
        tracer = self._tracer(f"decode{g}.{self._restarts}", role="decode", rank=g,
                              endpoint=self._endpoint(g))
        return self.decode_cls(g % self.scope.d_tp, self.scope.d_tp, self.d_dest[g],
                               destination_wait=10.0, request_deadline=FOREVER,
                               observer=tracer)

    def _schedule(self) -> list[list[tuple[int, int, bool]]]:
        """Chunked prefill: step k runs chunk k of every request that has one (C2)."""
        steps = []
        for k in range(max(len(r.chunks) for r in self.scope.requests)):
            steps.append([(i, r.chunks[k], k == len(r.chunks) - 1)
                          for i, r in enumerate(self.scope.requests) if k < len(r.chunks)])
        return steps

    def _params(self, i: int) -> dict:
        r = self.scope.requests[i]
        params = {"remote_host": f"d{self.instance_of(i)}", "remote_port": D_PORT,
                  "remote_tp_size": self.scope.d_tp,
                  "remote_engine_id": "decode-0", "do_remote_decode": True}
        if r.cached_tokens is not None:
            params["remote_cached_tokens"] = self._told_cached(r)
        return params

    def _told_cached(self, r: RequestSpec) -> int:
        """The cached tokens Prefill is told: none when dispatched early (C3)."""
        return 0 if self.scope.early_dispatch else (r.cached_tokens or 0)

    def _own_blocks(self, i: int) -> int:
        """Decode's own prefix hit of request ``i``, in blocks (C5)."""
        return (self.scope.requests[i].cached_tokens or 0) // BLOCK_TOKENS

    def _dispatched(self, i: int) -> bool:
        """C3: Prefill gets a request once every prompt of its list has its rendezvous, or
        at once when dispatched early."""
        if self.scope.early_dispatch:
            return True
        group = self.scope.requests[i].group
        if group < 0:
            return i in self.rendezvous
        return all(j in self.rendezvous for j, r in enumerate(self.scope.requests)
                   if r.group == group)

    # ------------------------------------------------------------------ operations
    def enabled(self, faults: bool = True, timers: bool = True) -> list[Op]:
        ops: list[Op] = []
        s = self.scope
        for p in range(s.p_tp):
            if self._prefill_can_step(p):
                ops.append(("prefill", p))
        for (p, d), q in self.to_d.items():
            if q:
                ops.append(("to_decode", p, d))
        for (p, d), q in self.to_p.items():
            if q:
                ops.append(("to_prefill", p, d))
        for g in range(self.n_d):
            if self.reads[g]:
                ops.append(("read", g))
        for i in range(self.n_req):
            if i in self.abandoned:
                continue
            if i not in self.rendezvous:
                ops.append(("rendezvous", i))
                if s.early_dispatch:
                    ops.append(("abandon", i))
            elif i not in self.lost and i not in self.outcome:
                ranks = self.ranks_of(self.instance_of(i))
                for g in ranks:
                    if i not in self.registered[g]:
                        ops.append(("register", g, i))
                if all(i in self.registered[g] for g in ranks) and all(
                        self.decode[g].local_outcome(self.ext[i]) is not None for g in ranks):
                    ops.append(("agree", i))
        progress = bool(ops)
        for d, core in enumerate(self.decode):
            if timers and (core.has_waiting_reads() or (not progress and
                                                        core.next_deadline() is not None)) \
                    and self._time_may_reach(max(self.now, core.next_deadline() or 0.0)):
                ops.append(("tick", d))
        if faults and self.faults < s.max_faults:
            kinds = s.fault_kinds
            if "fail_read" in kinds:
                ops += [("fail_read", g) for g in range(self.n_d) if not self.fail_next_read[g]]
            if "dup_reply" in kinds:
                ops += [("dup_reply", *key) for key, q in self.to_p.items() if q]
            if "replay_final" in kinds:
                ops += [("replay_final", *key) for key in self.ghost.last_final]
            if "garbage" in kinds:
                ops += [("garbage", *key) for key in self.to_d]
            if "restart_decode" in kinds:
                ops += [("restart_decode", inst) for inst in range(s.d_instances)]
            if "rogue" in kinds:
                ops += [("rogue_ready", *key) for key in self.ghost.last_ready]
                ops += [("rogue_meta", g) for g in range(self.n_d)]
            if "slow_reader" in kinds:
                # Bounded delivery (the assumption S6 states): Prefill's reply timeout only
                # fires once its READYs reached Decode; what Decode does then may be slow.
                ops += [("p_timeout", p) for p, core in enumerate(self.prefill)
                        if core.next_deadline() is not None
                        and not any(self.to_d[key] for key in self.to_d if key[0] == p)
                        and self._time_may_reach(max(self.now, core.next_deadline() or 0.0))]
        return ops

    def enabled_by_kind(self) -> dict[str, list[Op]]:
        """``enabled()`` grouped by operation kind, cached until the next ``apply``."""
        if self._by_kind is None:
            self._by_kind = {}
            for op in self.enabled():
                self._by_kind.setdefault(op[0], []).append(op)
        return self._by_kind

    def apply(self, op: Op) -> str:
        """Perform one operation; return a one-line description for counterexamples."""
        self._by_kind = None
        kind = op[0]
        if kind in FAULT_OPS:
            self.faults += 1
        return getattr(self, f"_op_{kind}")(*op[1:])

    def progress_pending(self) -> bool:
        return bool(self.enabled(faults=False))

    # Prefill --------------------------------------------------------------
    def _prefill_can_step(self, p: int) -> bool:
        step, layer, phase = self.p_pos[p]
        if step >= len(self.schedule):
            return False
        if phase != "begin":
            return True
        if layer == 0 and not all(self._dispatched(i) for i, _, _ in self.schedule[step]):
            return False
        return all(g.state in ("free", "failed") for g in self.prefill[p].gates_of(layer))

    def _op_prefill(self, p: int) -> str:
        step, layer, phase = self.p_pos[p]
        core = self.prefill[p]
        if phase == "begin":
            if layer == 0:
                for i, tokens, final in self.schedule[step]:
                    if i not in self.p_started[p]:
                        self.p_started[p].add(i)
                        core.add_request(self.ext[i], self._params(i), self.p_main_ids[i],
                                         self.p_idx_ids[i])
                    core.schedule_chunk(self.ext[i], tokens, final)
            try:
                core.layer_writable(layer)
            except LayerSendError:
                self.p_errors += 1  # S4: the compute path saw the failure instead of hanging
            slot = layer % self.scope.n_slots
            inv.check_s1_no_overwrite_while_read(self.ghost.readers.get((p, slot), {}),
                                                 f"P{p}", slot, layer)
            self._emit_prefill(p, core.begin_layer(layer, self.now), landed=False)
            self.p_pos[p] = (step, layer, "scatter")
            return f"P{p} begins writing layer {layer} (step {step})"
        if phase == "scatter":
            self._scatter(p, step, layer)
            self.p_pos[p] = (step, layer, "land")
            return f"P{p} scatter of layer {layer} lands in slot {layer % self.scope.n_slots}"
        actions = core.layer_landed(layer, self.now)
        self._emit_prefill(p, actions, landed=True)
        nxt = (step, layer + 1, "begin") if layer + 1 < self.scope.n_layers else (step + 1, 0,
                                                                                  "begin")
        self.p_pos[p] = nxt
        return f"P{p} device event of layer {layer} signalled; sends {len(actions)} frame(s)"

    def _source_bytes(self, req: IssueRead) -> bytes:
        """What the read's source ranges hold now (out-of-bounds ranges read as empty)."""
        mem = self.p_mem[int(req.session.split(":")[0][1:])]
        peer = req.plan.peer_addrs.astype(np.int64) - P_BASE
        n = req.plan.lengths.astype(np.int64)
        return b"".join(mem[max(a, 0):max(a + k, 0)].tobytes()
                        for a, k in zip(peer.tolist(), n.tolist(), strict=True))

    def _scatter(self, p: int, step: int, layer: int) -> None:
        mem = self.p_mem[p]
        base = self.p_tensor_base[layer % self.scope.n_slots]
        for i, tokens, _final in self.schedule[step]:
            spec = self.scope.requests[i]
            # Blocks completed before this chunk (or cached on Decode, as far as Prefill was
            # told) are not rewritten.
            done = spec.chunks[step - 1] if step else self._told_cached(spec)
            lo, hi = done // BLOCK_TOKENS, -(-tokens // BLOCK_TOKENS)
            for pos in range(lo, hi):
                for t, nbytes in enumerate(self.tbytes):
                    ids = self.p_main_ids[i] if t < 2 else self.p_idx_ids[i]
                    a = base[t] - P_BASE + int(ids[pos]) * nbytes
                    mem[a:a + nbytes] = pattern(i, layer, pos, t, nbytes)

    def _emit_prefill(self, p: int, actions: list, landed: bool) -> None:
        for a in actions:
            assert isinstance(a, Send)
            d = self._rank_of_endpoint(a.peer)
            if wire.layer_of(a.payload) is not None:
                msg = wire.decode(a.payload)
                assert isinstance(msg, wire.ReadReadyBatch)
                inv.check_c4_ready_after_landed(landed, f"P{p}", msg.layer_idx)
                slot = msg.layer_idx % self.scope.n_slots
                self.ghost.readers.setdefault((p, slot), Counter())[(f"D{d}", msg.layer_idx)] += 1
            self._to_decode(p, d, a.payload)
            self._trace_msg(f"prefill{p}", "send", a.peer, a.payload, self._identity(p, d))

    def _to_decode(self, p: int, d: int, payload: bytes) -> None:
        self.to_d[(p, d)].append(payload)
        self.to_d_sent[(p, d)].append(self.now)

    def _time_may_reach(self, t: float) -> bool:
        """Whether time may move on to ``t``: not past any frame's delivery bound (S6)."""
        return all(t <= q[0] + DELIVERY_BOUND_S for q in self.to_d_sent.values() if q)

    # network --------------------------------------------------------------
    def _op_to_decode(self, p: int, d: int) -> str:
        payload = self.to_d[(p, d)].popleft()
        self.to_d_sent[(p, d)].popleft()
        desc = f"D{d} receives {_describe(payload)} from P{p}"
        # A replayed READY legitimately rewrites what its original wrote (R4 is about
        # completion, not bytes), so its reads are left out of the write-once count.
        replay = self.ghost.replays[((p, d), payload)] > 0
        if replay:
            self.ghost.replays[((p, d), payload)] -= 1
        layer = wire.layer_of(payload)
        if layer is not None:
            self.ghost.readys[(p, d)] += 1
            try:
                msg = wire.decode(payload)
            except ProtocolError:
                msg = None
            if isinstance(msg, wire.ReadReadyBatch):
                inv.check_w1_meta_before_ready((p, d) in self.ghost.meta_seen, f"P{p}->D{d}",
                                               msg.layer_idx)
                # R1 is about what Decode heard before local completion: once reached, it
                # stands (R2) and later contributors change nothing.
                for e in msg.read_reqs:
                    if self._before_completion(d, e.ext_req_id):
                        self.ghost.ratios.setdefault((d, e.ext_req_id), set()).add(
                            msg.tp_ratio)
                for ext in msg.done_ext_ids:
                    if self._before_completion(d, ext):
                        self.ghost.finals.setdefault((d, ext), set()).add(
                            msg.group_member_idx)
                if msg.done_ext_ids:
                    self.ghost.last_final[(p, d)] = payload
                self.ghost.last_ready[(p, d)] = payload
                self._ready_in_hand = (p, msg, replay)
        elif _kind(payload) == wire.MF_META:
            self.ghost.meta_seen.add((p, d))
        self._trace_msg(f"decode{d}", "recv", self._identity(p, d), payload)
        actions = self.decode[d].on_frame(self._identity(p, d), payload, self.now)
        self._emit_decode(d, actions)
        self._ready_in_hand = None
        return desc

    def _before_completion(self, d: int, ext: str) -> bool:
        req = self.decode[d].requests.get(ext)
        return req is None or req.status.state == "registered"

    def _op_to_prefill(self, p: int, d: int) -> str:
        payload = self.to_p[(p, d)].popleft()
        desc = f"P{p} receives {_describe(payload)} from D{d}"
        try:
            msg = wire.decode(payload) if payload != wire.RAW_ACK else None
        except ProtocolError:
            msg = None
        if isinstance(msg, (wire.ReadDone, wire.ReadFailed)):
            readers = self.ghost.readers.get((p, msg.layer_idx % self.scope.n_slots))
            key = (f"D{d}", msg.layer_idx)
            if readers is not None and readers[key] > 0:
                readers[key] -= 1
        try:
            self._trace_msg(f"prefill{p}", "recv", self._endpoint(d), payload,
                            self._identity(p, d))
            actions = self.prefill[p].on_frame(self._endpoint(d), payload, self.now)
        except ProtocolError as exc:
            return desc + f" (rejected: {exc})"
        self._emit_prefill(p, actions, landed=True)
        return desc

    def _emit_decode(self, d: int, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send) and "rogue" in a.peer:
                self._trace_msg(f"decode{d}", "send", a.peer, a.payload)
                self.ghost.rogue_replies[a.peer] += 1  # the rogue reads nothing back
            elif isinstance(a, IssueRead) and self._ready_in_hand is not None and \
                    len(self._ready_in_hand) == 4:
                inv.check_w1_no_read_without_meta(f"D{d}", self._ready_in_hand[1].layer_idx)
            elif isinstance(a, Send):
                p = int(a.peer[1:].split("@")[0])
                self._trace_msg(f"decode{d}", "send", a.peer, a.payload)
                if a.peer != self._identity(p, d):
                    # Prefill replaced that connection (S5): the ROUTER cannot deliver to
                    # the old identity, and the core hears it, as DecodeWorker tells it.
                    self.decode[d].connection_lost(a.peer)
                    continue
                if _kind(a.payload) in (wire.READ_DONE, wire.READ_FAILED):
                    self.ghost.replies[(p, d)] += 1
                    inv.check_s3_one_reply_per_ready(self.ghost.readys[(p, d)],
                                                     self.ghost.replies[(p, d)],
                                                     f"P{p}<->D{d}", drained=False)
                self.to_p[(p, d)].append(a.payload)
            elif isinstance(a, IssueRead):
                if len(a.plan):
                    self.ghost.read_source[(d, a.read_id)] = self._source_bytes(a)
                if self._ready_in_hand is not None:
                    p, msg, replay = self._ready_in_hand
                    self.ghost.read_origin[(d, a.read_id)] = (p, msg.layer_idx,
                                                              msg.group_member_idx, replay)
                self.reads[d].append(a)
            # RequestReady / RequestFinished: the agreement operation polls local_outcome.

    # Decode transfers ----------------------------------------------------
    def _op_read(self, d: int) -> str:
        req = self.reads[d].popleft()
        origin = self.ghost.read_origin.pop((d, req.read_id), None)
        if self.fail_next_read[d]:
            self.fail_next_read[d] = False
            result = -1
        else:
            result = self._transfer(d, req, origin)
        actions = self.decode[d].read_result(req.read_id, result, self.now)
        before = self.ghost.read_source.pop((d, req.read_id), None)
        if before is not None and result == 0 and before != self._source_bytes(req):
            accepted = any(isinstance(a, Send) and _kind(a.payload) == wire.READ_DONE
                           for a in actions)
            inv.check_s6_no_torn_read(accepted, f"D{d} read {req.read_id}", req.session)
        self._emit_decode(d, actions)
        return f"D{d} batched read {req.read_id} ({len(req.plan)} descriptors) -> {result}"

    def _transfer(self, d: int, req: IssueRead,
                  origin: tuple[int, int, int, bool] | None) -> int:
        """The engine: bounds-check every descriptor, then copy all of them (or none)."""
        p = int(req.session.split(":")[0][1:])
        src, dst = self.p_mem[p], self.d_mem
        plan = req.plan
        local = plan.local_addrs.astype(np.int64) - D_BASE
        peer = plan.peer_addrs.astype(np.int64) - P_BASE
        n = plan.lengths.astype(np.int64)
        if (local < 0).any() or (local + n > dst.size).any() or (peer < 0).any() or \
                (peer + n > src.size).any():
            return -2
        main_written = 0
        for lo, ln in zip(local.tolist(), n.tolist(), strict=True):
            owners, is_main = self._owners(lo + D_BASE, ln, d)
            inv.check_c5_own_prefix_untouched(owners, f"D{d} read {req.read_id}")
            inv.check_r5_no_write_after_terminal(owners, f"D{d} read {req.read_id}")
            main_written += len(owners) if is_main else 0
        if origin is not None:
            inv.check_t2_main_once(origin[2], main_written, f"D{d} read from P{origin[0]}")
        if origin is not None and not origin[3]:
            for lo, ln in zip(local.tolist(), n.tolist(), strict=True):
                self._count_main_writes(lo + D_BASE, ln, d)
        for lo, pe, ln in zip(local.tolist(), peer.tolist(), n.tolist(), strict=True):
            dst[lo:lo + ln] = src[pe:pe + ln]
        return 0

    def _blocks_at(self, addr: int, length: int) -> tuple[str, int, int, int, range]:
        """The Decode region a descriptor writes into: (kind, layer, tensor, owner, blocks)."""
        k = int(np.searchsorted(self.region_starts, addr, side="right")) - 1
        start, end, kind, layer, tensor, owner = self.d_regions[k]
        nbytes = self._d_bytes(layer, tensor)
        first = (addr - start) // nbytes
        last = (min(addr + length, end) - 1 - start) // nbytes
        return kind, layer, tensor, owner, range(first, last + 1)

    def _count_main_writes(self, addr: int, length: int, d: int) -> None:
        kind, layer, tensor, owner, blocks = self._blocks_at(addr, length)
        if kind != "main":
            return
        for b in blocks:
            key = (owner, layer, tensor, b)
            self.ghost.main_writes[key] += 1
            inv.check_main_written_once(self.ghost.main_writes[key], f"D{d}",
                                        f"block {b} of layer {layer} tensor {tensor}")

    def _owners(self, addr: int, length: int, d: int) -> tuple[list[str | None], bool]:
        kind, _, _, owner, blocks = self._blocks_at(addr, length)
        table = self.block_owner[owner] if kind == "main" else self.idx_owner[owner]
        return [table[b] or None for b in blocks], kind == "main"

    # Decode scheduler ----------------------------------------------------
    def _mark_blocks(self, i: int, owner: str) -> None:
        inst = self.instance_of(i)
        # While the request lives, its first positions are Decode's own prefix (C5).
        own = self._own_blocks(i) if not owner.startswith("!") else 0
        self.block_owner[inst][self.d_main_ids[i]] = owner
        self.block_owner[inst][self.d_main_ids[i][:own]] = "=" + owner
        for g, ids in self.d_idx_ids[i].items():
            self.idx_owner[g][ids] = owner
            self.idx_owner[g][ids[:own]] = "=" + owner

    def _op_rendezvous(self, i: int) -> str:
        self.rendezvous.add(i)
        self._mark_blocks(i, self.ext[i])
        return (f"Decode instance {self.instance_of(i)} allocates {self.ext[i]} and posts its "
                "rendezvous (C1)")

    def _op_abandon(self, i: int) -> str:
        """The client left before Decode admitted request ``i``: vLLM ends it unallocated,
        and every rank of its instance forgets it, so READYs naming it (Prefill has it
        already: early dispatch) stop waiting for it (C1, C3)."""
        self.abandoned.add(i)
        for g in self.ranks_of(self.instance_of(i)):
            self._emit_decode(g, self.decode[g].forget_unregistered(self.ext[i], self.now))
        return f"Decode instance {self.instance_of(i)} ends {self.ext[i]} before allocating it"

    def _op_register(self, g: int, i: int) -> str:
        self.registered[g].add(i)
        own = self._own_blocks(i)
        actions = self.decode[g].register_request(
            self.ext[i], self.d_main_ids[i], self.d_idx_ids[i][g], self.now, own_main=own,
            own_indexer=own)
        self._emit_decode(g, actions)
        return f"D{g} worker registers destinations of {self.ext[i]}"

    def _op_agree(self, i: int) -> str:
        ext = self.ext[i]
        ranks = self.ranks_of(self.instance_of(i))
        all_ok = all(self.decode[g].local_outcome(ext) for g in ranks)
        finished = {}
        for g in ranks:
            for a in self.decode[g].apply_agreement(ext, all_ok):
                finished[g] = a.ok
        inv.check_r2_ranks_agree(ext, finished)
        ok = all(finished.values())
        self.outcome[i] = ok
        if ok:
            for g in ranks:
                inv.check_r1_success_needs_all(ext, f"D{g}", self.ghost.ratios.get((g, ext), set()),
                                               self.ghost.finals.get((g, ext), set()))
            self._check_bytes(i)
        self._mark_blocks(i, "!" + ext)
        return f"Decode TP group agrees: {ext} {'succeeded' if ok else 'failed'} (R1, R2)"

    def _check_bytes(self, i: int) -> None:
        """Every byte of every layer of a successful request equals the Prefill bytes."""
        r = self.scope.requests[i]
        first = self._own_blocks(i)
        inst = self.instance_of(i)
        for layer in range(self.scope.n_layers):
            for t, nbytes in enumerate(self.tbytes):
                dbytes = self._d_bytes(layer, t)
                owners = [inst] if t < 2 else list(self.ranks_of(inst))
                for d in owners:
                    ids = self.d_main_ids[i] if t < 2 else self.d_idx_ids[i][d]
                    base = next(rg[0] for rg in self.d_regions if rg[3] == layer
                                and rg[4] == t and rg[5] == d)
                    for pos in range(first, r.blocks):
                        a = base - D_BASE + int(ids[pos]) * dbytes
                        got = self.d_mem[a:a + dbytes]
                        inv.check_data(self.ext[i], f"layer {layer} tensor {t} block {pos}"
                                       f"{'' if t < 2 else f' on D{d}'}", got,
                                       pattern(i, layer, pos, t, nbytes))

    # timers and faults ---------------------------------------------------
    def _op_tick(self, d: int) -> str:
        deadline = self.decode[d].next_deadline()
        self.now = max(self.now, deadline)
        self.timer_fired = True
        actions = self.decode[d].tick(self.now)
        self._emit_decode(d, actions)
        return f"D{d} timers fire at t={self.now:g}"

    def _op_p_timeout(self, p: int) -> str:
        """Prefill's reply timeout fires (S5): it gives up on the late readers, fails their
        outstanding reads and replaces their connections, and may reuse the slots, while
        those readers' reads may still be in flight on Decode (S6 must then refuse them)."""
        core = self.prefill[p]
        deadline = core.next_deadline()
        assert deadline is not None
        self.now = max(self.now, deadline)
        lost = []
        for a in core.tick(self.now):
            assert isinstance(a, Disconnect), a
            g = self._rank_of_endpoint(a.peer)
            tracer = self._trace_of.get(f"prefill{p}")
            if tracer is not None:
                tracer.connection("lost", a.peer, self._identity(p, g))
            self._conn_gen[(p, g)] += 1
            self._forget_connection((p, g))  # replies on the old one never arrive
            self.ghost.last_ready.pop((p, g), None)
            # Prefill no longer waits for this reader: its slot may be rewritten (S5); a
            # read still in flight is S6's to refuse.
            for (pp, _slot), counter in self.ghost.readers.items():
                if pp == p:
                    for reader in [r for r in counter if r[0] == f"D{g}"]:
                        del counter[reader]
            lost.append(f"D{g}")
        return f"fault: P{p}'s reply timeout fires at t={self.now:g}; gives up on {lost} (S5)"

    def _op_fail_read(self, d: int) -> str:
        self.fail_next_read[d] = True
        return f"fault: D{d}'s next batched read will fail"

    def _op_dup_reply(self, p: int, d: int) -> str:
        q = self.to_p[(p, d)]
        q.insert(1, q[0])
        return f"fault: D{d}'s next reply to P{p} is duplicated"

    def _op_replay_final(self, p: int, d: int) -> str:
        self._to_decode(p, d, self.ghost.last_final[(p, d)])
        self.ghost.replays[((p, d), self.ghost.last_final[(p, d)])] += 1
        return f"fault: P{p}'s last final-layer READY reaches D{d} again (R4)"

    def _op_rogue_ready(self, p: int, d: int) -> str:
        """A peer outside the project's Prefill discipline (an upstream-style or hostile
        Prefill) replays P{p}'s last READY to D{d} on a new connection, without MF_META."""
        payload = self.ghost.last_ready[(p, d)]
        self._rogues += 1
        peer = f"p{p}@rogue{self._rogues}"
        self._trace_msg(f"decode{d}", "recv", peer, payload)
        self._ready_in_hand = (p, wire.decode(payload), True, "rogue")
        try:
            actions = self.decode[d].on_frame(peer, payload, self.now)
            self._emit_decode(d, actions)
        finally:
            self._ready_in_hand = None
        inv.check_s3_one_reply_per_ready(1, self.ghost.rogue_replies[peer], f"{peer}<->D{d}",
                                         drained=True)
        return f"fault: a rogue peer replays P{p}'s last READY to D{d} without MF_META (W1)"

    def _op_rogue_meta(self, d: int) -> str:
        """A peer sends an MF_META Decode cannot accept; it must be answered, not ignored."""
        self._rogues += 1
        peer = f"p0@rogue{self._rogues}"
        payload = msgpack.packb([wire.MF_META, "rogue:1", b"\x01", 1, 0, 1], use_bin_type=True)
        self._trace_msg(f"decode{d}", "recv", peer, payload)
        self._emit_decode(d, self.decode[d].on_frame(peer, payload, self.now))
        inv.check_meta_answered(self.ghost.rogue_replies[peer], f"{peer}<->D{d}")
        return f"fault: a rogue peer sends D{d} an MF_META it cannot accept (W1, F3)"

    def _op_garbage(self, p: int, d: int) -> str:
        bad = msgpack.packb([wire.READ_READY_BATCH, self.scope.n_layers - 1, "layer.x",
                             [["r", [-1], [], 0, 0]], [], 0, 1], use_bin_type=True)
        self._to_decode(p, d, bad)
        return f"fault: a malformed READY from P{p} reaches D{d} (W5)"

    def _op_restart_decode(self, inst: int) -> str:
        """A Decode instance restarts on the same ports: its requests, connections and
        in-flight traffic are gone; Prefill's socket monitor reports the peers lost."""
        ranks = self.ranks_of(inst)
        self._restarts += 1
        for p in range(self.scope.p_tp):
            g = inst * self.scope.d_tp + self.mapping.d_rank(p)
            tracer = self._trace_of.get(f"prefill{p}")
            if tracer is not None:
                tracer.connection("lost", self._endpoint(g), self._identity(p, g))
        self._epoch[inst] += 1
        for g in ranks:
            tracer = self._trace_of.get(f"decode{g}")
            if tracer is not None:
                tracer.abandon()
        for g in ranks:
            self.decode[g] = self._new_decode(g)
            self.reads[g].clear()
            self.registered[g] = set()
        for i in self.rendezvous:
            if self.instance_of(i) == inst and i not in self.outcome:
                self.lost.add(i)
                self._mark_blocks(i, "!" + self.ext[i])
        for key in self.to_d:
            if key[1] in ranks:
                self._forget_connection(key)
        for counter in self.ghost.readers.values():
            for reader in [r for r in counter if self._rank_of_reader(r[0]) in ranks]:
                del counter[reader]
        self.ghost.read_origin = {k: v for k, v in self.ghost.read_origin.items()
                                  if k[0] not in ranks}
        for p, core in enumerate(self.prefill):
            g = inst * self.scope.d_tp + self.mapping.d_rank(p)
            core.peer_gone(self._endpoint(g), self.now, "decode restarted")
        return f"fault: Decode instance {inst} restarts (S5, W1)"

    def _forget_connection(self, key: tuple[int, int]) -> None:
        """The (Prefill, Decode) connection is gone: its traffic in flight and what the
        ghost counted on it go with it."""
        self.to_d[key].clear()
        self.to_d_sent[key].clear()
        self.to_p[key].clear()
        self.ghost.readys[key] = self.ghost.replies[key] = 0
        self.ghost.meta_seen.discard(key)
        self.ghost.last_final.pop(key, None)

    @staticmethod
    def _rank_of_reader(name: str) -> int:
        return int(name[1:])

    # ------------------------------------------------------------------ quiescence
    def check_quiescent(self) -> None:
        """Called when no progress operation is enabled: nothing may be left hanging."""
        problems = []
        for p, core in enumerate(self.prefill):
            step, layer, _ = self.p_pos[p]
            if step < len(self.schedule):
                states = [g.state for g in core.gates_of(layer)]
                problems.append(f"P{p} blocked before layer {layer} of step {step}: "
                                f"gates {states}")
        for i in range(self.n_req):
            if i in self.rendezvous and i not in self.outcome and i not in self.lost:
                problems.append(f"{self.ext[i]} never reached a terminal state")
        for (p, d) in self.to_d:
            inv.check_s3_one_reply_per_ready(self.ghost.readys[(p, d)],
                                             self.ghost.replies[(p, d)], f"P{p}<->D{d}",
                                             drained=True)
        inv.check_quiescence(problems)
        inv.check_r3_independent(g.state for core in self.prefill for g in core.gates.values())
        clean = (self.faults == 0 and not self.timer_fired and self.scope.legacy_rank is None
                 and self.scope.layout_mismatch_layer is None)
        if clean:
            failed = [self.ext[i] for i, ok in self.outcome.items() if not ok]
            if failed:
                raise inv.InvariantViolation(
                    "R1", f"{failed} failed although no fault was injected and no timer fired")

    # ------------------------------------------------------------------ exploration
    def canonical(self) -> tuple:
        """A hashable digest of everything that matters for future behaviour."""
        prefill = tuple(
            (tuple(g.snapshot() for g in core.gates.values()),
             tuple((k, ep.session.state, len(ep.held)) for k, ep in sorted(core.endpoints.items())),
             tuple(sorted((k, r.sent_blocks, r.chunk) for k, r in core.requests.items())),
             core.stale_replies)
            for core in self.prefill)
        decode = tuple(
            (tuple(sorted(core.connections)),
             tuple(sorted((k, r.status.snapshot(), r.inflight) for k, r in core.requests.items())),
             tuple(sorted(core.terminal.items())),
             tuple(r.read.key.rsplit("/", 1)[0] for r in core.waiting_reads()))
            for core in self.decode)
        net = tuple((k, tuple(self.to_d[k]), tuple(self.to_p[k])) for k in sorted(self.to_d))
        reads = tuple(tuple((r.session, r.plan.local_addrs.tobytes(), r.plan.peer_addrs.tobytes())
                            for r in q) for q in self.reads)
        return (prefill, decode, net, reads, tuple(self.p_pos), tuple(sorted(self.rendezvous)),
                tuple(sorted(self.abandoned)),
                tuple(tuple(sorted(r)) for r in self.registered),
                tuple(sorted(self.outcome.items())),
                tuple(m.tobytes() for m in self.p_mem), self.d_mem.tobytes())


def _describe(payload: bytes) -> str:
    if payload == wire.RAW_ACK:
        return "ACK"
    try:
        msg = wire.decode(payload)
    except ProtocolError as exc:
        return f"a malformed frame ({str(exc)[:60]})"
    if isinstance(msg, wire.ReadReadyBatch):
        reqs = ", ".join(f"{e.ext_req_id}:{len(e.p_main_block_ids)}m/{len(e.p_indexer_block_ids)}i"
                         for e in msg.read_reqs)
        done = f" done={list(msg.done_ext_ids)}" if msg.done_ext_ids else ""
        return (f"READY layer {msg.layer_idx} [{reqs}]{done} member {msg.group_member_idx}/"
                f"{msg.tp_ratio}")
    if isinstance(msg, wire.MfMeta):
        return "MF_META"
    if isinstance(msg, wire.MfMetaAck):
        return "MF_META_ACK" + ("" if msg.accepted else f" refused: {msg.error}")
    if isinstance(msg, wire.ReadDone):
        return f"READ_DONE layer {msg.layer_idx}"
    if isinstance(msg, wire.ReadFailed):
        return f"READ_FAILED layer {msg.layer_idx} ({msg.error[:60]})"
    return type(msg).__name__


def _kind(payload: bytes) -> bytes | None:
    """The message kind of a frame without validating the rest (ghost bookkeeping only)."""
    try:
        head = msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001 - raw ACK or garbage: no kind
        return None
    return head[0] if isinstance(head, list) and head and isinstance(head[0], bytes) else None


def scope_to_json(scope: Scope) -> dict:
    """A JSON-able form of a scope, for pinned counterexamples."""
    return {
        "p_tp": scope.p_tp, "d_tp": scope.d_tp, "n_layers": scope.n_layers,
        "n_slots": scope.n_slots, "indexer": scope.indexer, "scale": scope.scale,
        "requests": [[r.tokens, list(r.chunks), r.cached_tokens, r.group]
                     for r in scope.requests],
        "layout_mismatch_layer": scope.layout_mismatch_layer,
        "legacy_rank": scope.legacy_rank, "empty_entries": scope.empty_entries,
        "d_instances": scope.d_instances,
        "max_faults": scope.max_faults, "fault_kinds": sorted(scope.fault_kinds),
        "early_dispatch": scope.early_dispatch,
    }


def scope_from_json(obj: dict) -> Scope:
    fields = dict(obj)
    fields["requests"] = tuple(RequestSpec(t, tuple(c), cached, g)
                               for t, c, cached, g in obj["requests"])
    fields["fault_kinds"] = frozenset(obj["fault_kinds"])
    return Scope(**fields)
