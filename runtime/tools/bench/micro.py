"""The micro benchmarks of ``sfa-rd2h bench``: read planning, the wire codec, the machines,
the Decode core and planning at scale, each next to an in-process baseline."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgpack
import numpy as np

from sfa_rd2h.runtime.tools.bench.common import BenchError, Result, Sizes, compare
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.layout import DestLayout, ReadPlan, plan_layer_reads, validate_layer

# --------------------------------------------------------------------------- 1. read planning

# Bytes per block of K, V, indexer and LIC8 scale. Planning moves no bytes, so these only set
# address strides; they differ per tensor so a stride mix-up cannot go unnoticed in the check.
_TENSOR_BYTES = (512 << 10, 512 << 10, 8 << 10, 256)


@dataclass(frozen=True)
class LayerCase:
    """One layer's source and destination layouts and per-request (src, dst) id lists."""

    src: wire.LayerMeta
    dst: DestLayout
    src_main: list[tuple[int, ...]]
    dst_main: list[np.ndarray]
    src_idx: list[tuple[int, ...]]
    dst_idx: list[np.ndarray]


def _runs_of(pool: int, run: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct ids from ``0..pool-1`` in shuffled runs of ``run`` consecutive ids."""
    starts = rng.permutation(pool // run)[: -(-count // run)] * run
    return (starts[:, None] + np.arange(run)).reshape(-1)[:count]


def _layouts(pool: int) -> tuple[wire.LayerMeta, DestLayout]:
    """Source and destination of K, V, indexer and LIC8 scale, ``pool`` blocks each, every
    tensor 1 TiB apart so no two tensors' ranges can overlap at any benchmark size."""
    sizes = _TENSOR_BYTES
    src = wire.LayerMeta(
        base_addrs=tuple(0x7F00_0000_0000 + (t << 40) for t in range(len(sizes))),
        block_len=sizes, block_size_scale=(1,) * len(sizes),
        tensor_group_idx=(0, 0, 1, 1), main_tensor_count=2, has_indexer=True)
    dst = DestLayout(
        base_addrs=tuple(0x6E00_0000_0000 + (t << 40) for t in range(len(sizes))),
        block_bytes=sizes, num_blocks=(pool,) * len(sizes),
        main_tensor_count=2, has_indexer=True, has_scale=True)
    return src, dst


def layer_case(requests: int, blocks: int, seed: int = 1) -> LayerCase:
    """K, V, indexer and LIC8 scale; ids "partially contiguous" the way caches fragment.

    Prefill ids come in runs of 3 consecutive blocks and Decode ids in runs of 8, each side
    shuffled on its own, so a descriptor covers one to three blocks depending on where the
    two sides' run boundaries fall.
    """
    rng = np.random.default_rng(seed)
    n = requests * blocks
    pool = 4 * n  # blocks are drawn from a cache four times larger than this layer needs
    src, dst = _layouts(pool)

    def per_request(run: int) -> list[np.ndarray]:
        return list(_runs_of(pool, run, n, rng).reshape(requests, blocks))

    # READY carries Prefill ids as tuples of ints; Decode's destinations are numpy slices.
    return LayerCase(
        src, dst,
        src_main=[tuple(a.tolist()) for a in per_request(3)],
        dst_main=per_request(8),
        src_idx=[tuple(a.tolist()) for a in per_request(3)],
        dst_idx=per_request(8),
    )


def plan_layer(case: LayerCase) -> ReadPlan:
    """The project's per-layer planning, as the Decode core runs it: the ids of every
    request joined, one plan for the whole layer."""
    return plan_layer_reads(case.src, case.dst,
                            np.fromiter(itertools.chain.from_iterable(case.src_main), np.int64),
                            np.concatenate(case.dst_main),
                            np.fromiter(itertools.chain.from_iterable(case.src_idx), np.int64),
                            np.concatenate(case.dst_idx))


def naive_plan_layer(case: LayerCase) -> tuple[list[int], list[int], list[int]]:
    """Baseline: the same checks and descriptors with one Python iteration per block.

    The layout check is the project's (it is per tensor, not per block); the range checks,
    address arithmetic and run merging are the per-block loop principle 4 rules out.
    """
    src, dst = case.src, case.dst
    main = src.main_tensor_count
    n_tensors = len(src.base_addrs)
    ext = src.ext_block_bytes
    groups = (range(main), range(main, n_tensors))
    validate_layer(src, dst)
    pairs = (
        ([s for ids in case.src_main for s in ids], [d for a in case.dst_main for d in a.tolist()]),
        ([s for ids in case.src_idx for s in ids], [d for a in case.dst_idx for d in a.tolist()]),
    )
    for (sids, dids), tensors in zip(pairs, groups, strict=True):
        if len(sids) != len(dids):
            raise ProtocolError("L1: block id counts differ")
        cap = min(dst.num_blocks[t] for t in tensors)
        seen: set[int] = set()
        for s, d in zip(sids, dids, strict=True):
            if s < 0 or d < 0 or d >= cap or d in seen:
                raise ProtocolError(f"L1: bad block pair {s} -> {d}")
            seen.add(d)
    local: list[int] = []
    peer: list[int] = []
    lengths: list[int] = []
    for (sids, dids), tensors in zip(pairs, groups, strict=True):
        for t in tensors:
            nbytes, s_base, d_base = ext[t], src.base_addrs[t], dst.base_addrs[t]
            for s, d in zip(sids, dids, strict=True):
                lo, pe = d_base + d * nbytes, s_base + s * nbytes
                if local and local[-1] + lengths[-1] == lo and peer[-1] + lengths[-1] == pe:
                    lengths[-1] += nbytes
                else:
                    local.append(lo)
                    peer.append(pe)
                    lengths.append(nbytes)
    return local, peer, lengths


def _check_plan(plan: ReadPlan, naive: tuple[list[int], list[int], list[int]],
                what: str) -> None:
    got = (plan.local_addrs, plan.peer_addrs, plan.lengths)
    for name, a, b in zip(("local_addrs", "peer_addrs", "lengths"), got, naive, strict=True):
        if not np.array_equal(a, np.asarray(b, dtype=np.uint64)):
            raise BenchError(f"{what}: {name} of the project plan differs from the naive loop")


def bench_plan(sizes: Sizes) -> Result:
    case = layer_case(sizes.requests, sizes.blocks)
    plan = plan_layer(case)
    _check_plan(plan, naive_plan_layer(case), "plan_layer_reads")
    med, base, info = compare(lambda: plan_layer(case), lambda: naive_plan_layer(case),
                              sizes.repeat, sizes.sample_s)
    return Result(
        "plan_layer_reads", med, base, "us/layer", 1e6,
        f"{sizes.requests} req x {sizes.blocks} blocks, K/V+indexer+scale "
        f"-> {len(plan)} descriptors; vs per-block Python loop",
        {"verified": True, "requests": sizes.requests, "blocks": sizes.blocks, "tensors": 4,
         "descriptors": len(plan), "block_pairs": 4 * sizes.requests * sizes.blocks,
         "baseline": "naive per-block Python loop, same checks and descriptors", **info})


# --------------------------------------------------------------------------- 2. wire


def ready_message(entries: int, ids: int, seed: int = 2) -> wire.ReadReadyBatch:
    rng = np.random.default_rng(seed)
    reqs = tuple(
        wire.ReadReq(f"req-{i:05d}", tuple(rng.integers(0, 1 << 20, ids).tolist()),
                     tuple(rng.integers(0, 1 << 20, ids).tolist()), 0, 0)
        for i in range(entries))
    return wire.ReadReadyBatch(17, "model.layers.17.self_attn.attn", reqs, (), 0, 1)


def ready_fields(msg: wire.ReadReadyBatch) -> tuple[Any, ...]:
    """The W2 field tuple of ``msg``, written out here so the baseline shares no wire code."""
    return (wire.READ_READY_BATCH, msg.layer_idx, msg.layer_name,
            tuple((r.ext_req_id, r.p_main_block_ids.tolist(), r.p_indexer_block_ids.tolist(),
                   r.main_dest_start, r.indexer_dest_start) for r in msg.read_reqs),
            msg.done_ext_ids, msg.group_member_idx, msg.tp_ratio)


def bench_wire(sizes: Sizes) -> Result:
    msg = ready_message(sizes.wire_entries, sizes.wire_ids)
    fields = ready_fields(msg)
    frame = wire.encode(msg)
    # The baseline must move the very same bytes, or the ratio compares different work.
    if msgpack.packb(fields) != frame or wire.decode(frame) != msg:
        raise BenchError("wire_ready_roundtrip: plain msgpack and wire.encode disagree")
    med, base, info = compare(lambda: wire.decode(wire.encode(msg)),
                              lambda: msgpack.unpackb(msgpack.packb(fields)),
                              sizes.repeat, sizes.sample_s)
    return Result(
        "wire_ready_roundtrip", med, base, "us/msg", 1e6,
        f"READY {sizes.wire_entries} entries x 2x{sizes.wire_ids} ids ({len(frame)} B); "
        "vs plain msgpack",
        {"verified": True, "entries": sizes.wire_entries, "ids_per_list": sizes.wire_ids,
         "frame_bytes": len(frame), "id_scanner": wire.ID_SCANNER,
         "baseline": "msgpack.unpackb(msgpack.packb(fields)), no validation", **info})


# --------------------------------------------------------------------------- 3. machines


_READERS = frozenset({"decode-0"})


def bench_machines(sizes: Sizes) -> list[Result]:
    from transitions import Machine
    from transitions.extensions import LockedMachine

    from sfa_rd2h.statemachines.engine import Driver, build_machine
    from sfa_rd2h.statemachines.models import SlotGate
    from sfa_rd2h.statemachines.tables import PREFILL_SLOT

    class DictSlotGate(SlotGate):
        """SlotGate with a ``__dict__``: ``add_model`` binds trigger methods onto the model,
        which a slots class refuses. Same guards and effects."""

    driver = Driver(PREFILL_SLOT)
    fire = driver.fire

    def driver_cycle(g: SlotGate) -> None:
        fire(g, "begin_write", 0)
        fire(g, "scatter_landed")
        fire(g, "publish", _READERS)
        fire(g, "reply_done", "decode-0")

    def model_cycle(g: Any) -> None:
        g.begin_write(0)
        g.scatter_landed()
        g.publish(_READERS)
        g.reply_done("decode-0")

    def attached(machine_cls: type[Machine]) -> DictSlotGate:
        model = DictSlotGate("slot-0")
        build_machine(PREFILL_SLOT, machine_cls).add_model(model)
        return model

    gate = driver.start(SlotGate("slot-0"))
    plain, locked = attached(Machine), attached(LockedMachine)
    for g, cycle in ((gate, driver_cycle), (plain, model_cycle), (locked, model_cycle)):
        cycle(g)
        if (g.state, g.publication, g.owner, g.pending) != ("free", 1, None, set()):
            raise BenchError(f"machine cycle on {type(g).__name__} ended in {g.state!r}")

    results = []
    for name, model, baseline in (
        ("machine_fire_cycle", plain, "Machine.add_model + model trigger methods"),
        ("machine_fire_vs_locked", locked, "LockedMachine.add_model + model trigger methods"),
    ):
        med, base, info = compare(partial(driver_cycle, gate), partial(model_cycle, model),
                                  sizes.repeat, sizes.sample_s)
        results.append(Result(
            name, med, base, "us/cycle", 1e6,
            f"Driver.fire x4, SlotGate write/land/publish/reply; vs {baseline.split('.')[0]}",
            {"verified": True, "triggers": 4, "baseline": baseline,
             "project_us_per_trigger": med / 4 * 1e6, "baseline_us_per_trigger": base / 4 * 1e6,
             **info}))

    # A request's lifetime with N in flight: the Driver keeps no per-model registry, while
    # add_model's per-call membership test walks every live model (quadratic in N).
    per_request: dict[int, tuple[float, float]] = {}
    for name, n in (("machine_requests_n", sizes.models),
                    ("machine_requests_4n", 4 * sizes.models)):
        machine = build_machine(PREFILL_SLOT, Machine)

        def with_driver(n: int = n) -> None:
            gates = [driver.start(SlotGate(f"slot-{i}")) for i in range(n)]
            for g in gates:
                driver_cycle(g)

        def with_add_model(n: int = n, machine: Machine = machine) -> None:
            gates = [DictSlotGate(f"slot-{i}") for i in range(n)]
            for g in gates:
                machine.add_model(g)
            for g in gates:
                model_cycle(g)
            machine.remove_model(gates)

        with_add_model()
        if machine.models:
            raise BenchError("add_model baseline left models attached")
        med, base, info = compare(with_driver, with_add_model, sizes.repeat, sizes.sample_s)
        per_request[n] = (med / n, base / n)
        results.append(Result(
            name, med / n, base / n, "us/request", 1e6,
            f"{n} live SlotGates: start + 4 triggers; vs add_model + 4 triggers + remove_model",
            {"verified": True, "models": n,
             "baseline": "Machine.add_model per request, all live at once, then remove_model",
             **info}))
    (n1, (p1, b1)), (n4, (p4, b4)) = sorted(per_request.items())
    # Per-request cost that grows with N is the quadratic total the architecture warns of.
    results[-1].detail["growth"] = {"from_models": n1, "to_models": n4,
                                    "project_per_request": round(p4 / p1, 3),
                                    "baseline_per_request": round(b4 / b1, 3)}
    return results


# --------------------------------------------------------------------------- 4. Decode core


def bench_decode_core(sizes: Sizes) -> list[Result]:
    """One Decode layer in the core at each request count of the sweep, each next to
    decoding its READY alone: ``decode_core_layer`` at the figure's size (``requests``),
    ``decode_core_layer_<N>req`` at the others."""
    rows = [_decode_core_layer(sizes, n, "decode_core_layer" if n == sizes.requests
                               else f"decode_core_layer_{n}req")
            for n in sorted({*sizes.decode_requests, sizes.requests})]
    return [*rows, _decode_core_layer(sizes, sizes.requests, "decode_core_layer_cold",
                                      cold=True)]


def _decode_core_layer(sizes: Sizes, requests: int, name: str, cold: bool = False) -> Result:
    """Every layer of a step carries the same entries, and the core serves a layer that
    repeats the last one's from what that one learned: the plain rows measure such a
    layer (all but the first of a step). ``cold`` alternates two READYs of the same
    requests in opposite orders, so nothing repeats and every call plans afresh, as a
    step's first layer does."""
    from sfa_rd2h.statemachines.cores.actions import IssueRead, Send
    from sfa_rd2h.statemachines.cores.decode import DecodeCore

    case = layer_case(requests, sizes.blocks)
    peer, layer = "prefill-0", "model.layers.0.self_attn.attn"
    core = DecodeCore(0, 1, {layer: case.dst})
    meta = wire.MfMeta("10.0.0.1:7000", {layer: case.src}, wire.PROTOCOL_VERSION)
    core.on_frame(peer, wire.encode(meta), 0.0)
    entries = []
    for i, (sm, dm, si, di) in enumerate(zip(case.src_main, case.dst_main, case.src_idx,
                                             case.dst_idx, strict=True)):
        core.register_request(f"req-{i}", dm, di, 0.0)
        entries.append(wire.ReadReq(f"req-{i}", sm, si, 0, 0))
    # No done_ext_ids: every request stays live, so each call serves the same layer afresh.
    frame = wire.encode(wire.ReadReadyBatch(0, layer, tuple(entries), (), 0, 1))
    frames = [frame]
    if cold:
        frames.append(wire.encode(wire.ReadReadyBatch(0, layer, tuple(entries[::-1]), (),
                                                      0, 1)))
    done = wire.encode(wire.ReadDone(0))
    served, decoded = itertools.cycle(frames), itertools.cycle(frames)

    def serve_layer() -> list[Any]:
        [issue] = core.on_frame(peer, next(served), 0.0)
        return core.read_result(issue.read_id, 0, 0.0)  # type: ignore[union-attr]

    for k, f in enumerate(frames):
        [issue] = core.on_frame(peer, f, 0.0)
        if not isinstance(issue, IssueRead):
            raise BenchError(f"{name}: expected one IssueRead, got {issue!r}")
        if k == 0:
            _check_plan(issue.plan, naive_plan_layer(case), name)
        reply = core.read_result(issue.read_id, 0, 0.0)
        if reply != [Send(peer, done)]:
            raise BenchError(f"{name}: expected one READ_DONE, got {reply!r}")
    med, base, info = compare(serve_layer, lambda: wire.decode(next(decoded)), sizes.repeat,
                              sizes.sample_s)
    kind = ", nothing repeats (a step's first layer)" if cold else ""
    return Result(
        name, med, base, "us/layer", 1e6,
        f"on_frame(READY) -> IssueRead -> read_result -> READ_DONE, {requests} req{kind}; "
        "vs wire.decode alone",
        {"verified": True, "requests": requests, "blocks": sizes.blocks, "repeats": not cold,
         "project_us_per_request": med / requests * 1e6,
         "baseline": "wire.decode of the same READY frame", "id_scanner": wire.ID_SCANNER,
         **info})



# --------------------------------------------------------------------------- 7. planning scale


def scale_case(n: int, contiguous: bool, seed: int = 4) -> LayerCase:
    """One layer of ``n`` block pairs (100 requests), K/V + indexer + scale: ids either in
    one run per request on both sides (a few descriptors) or drawn at random from a cache
    four times larger (about one descriptor per block and tensor)."""
    requests = 100
    blocks = max(1, n // requests)
    total = requests * blocks
    rng = np.random.default_rng(seed)
    pool = 4 * total
    src, dst = _layouts(pool)

    def ids() -> np.ndarray:
        flat = np.arange(total, dtype=np.int64) if contiguous else \
            rng.permutation(pool)[:total].astype(np.int64)
        return flat.reshape(requests, blocks)

    return LayerCase(src, dst, [tuple(a.tolist()) for a in ids()], list(ids()),
                     [tuple(a.tolist()) for a in ids()], list(ids()))


def bench_plan_scale(sizes: Sizes) -> list[Result]:
    """plan_layer_reads at growing block counts, next to the per-block loop; the per-block
    cost says whether growth is linear."""
    results = []
    for n in sizes.plan_blocks:
        for contiguous in (True, False):
            case = scale_case(n, contiguous)
            plan = plan_layer(case)
            _check_plan(plan, naive_plan_layer(case), f"plan_scale {n}")
            # The loop baseline at 100k blocks lasts ~1 s a call: fewer samples there.
            rep = sizes.repeat if n <= 10_000 else min(sizes.repeat, 3)
            med, base, info = compare(lambda c=case: plan_layer(c),
                                      lambda c=case: naive_plan_layer(c), rep,
                                      sizes.sample_s)
            kind = "runs" if contiguous else "scattered"
            label = f"{n // 1000}k"
            results.append(Result(
                f"plan_scale_{label}_{kind}", med, base, "ms/layer", 1e3,
                f"plan_layer_reads, {n} block pairs x 4 tensors, {kind} -> {len(plan)} "
                "descriptors; vs per-block Python loop",
                {"verified": True, "block_pairs": n, "contiguous": contiguous,
                 "descriptors": len(plan), "ns_per_block": med / n * 1e9, **info}))
    return results



# --------------------------------------------------------------------------- 8. READY memory

# Runs in a child process, so its peak RSS is the Decode core's alone: a Decode core that
# handshook, then READYs of the largest legal size (1-byte ids: the worst case for growth)
# for requests it does not know yet, which it must hold until their destinations come (C1).
_READY_MEMORY_CHILD = r"""
import gc, json, sys
import msgpack, numpy as np
from sfa_rd2h.spec import wire
from sfa_rd2h.spec.layout import DestLayout
from sfa_rd2h.statemachines.cores.decode import DecodeCore

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

frames, size = int(sys.argv[1]), int(sys.argv[2])
meta = wire.LayerMeta((0x10000, 0x20000), (16, 16), (1, 1), (0, 0), 2, False)
dest = DestLayout((0x900000, 0x910000), (16, 16), (1 << 20, 1 << 20), 2, False, False)
core = DecodeCore(0, 1, {"l0": dest}, destination_wait=1.0)
core.on_frame("p", wire.encode(wire.MfMeta("s", {"l0": meta}, 1)), 0.0)
per_list = wire.MAX_BLOCKS_PER_ENTRY
ids = b"\xdd" + per_list.to_bytes(4, "big") + np.random.default_rng(3).integers(
    0, 128, per_list, dtype=np.uint8).tobytes()  # one msgpack array of fixint ids
n_entries = max(1, (size - 64 * 1024) // (2 * len(ids)))
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
base = status("VmRSS")
sent = 0
for k in range(frames):
    parts = [b"\x97", msgpack.packb(wire.READ_READY_BATCH), b"\x00", msgpack.packb("l0"),
             b"\xdd" + n_entries.to_bytes(4, "big")]
    for i in range(n_entries):
        parts += [b"\x95", msgpack.packb(f"f{k}-r{i}"), ids, ids, b"\x00", b"\x00"]
    frame = b"".join(parts + [b"\x90\x00\x01"])
    del parts
    sent += len(frame)
    assert core.on_frame("p", frame, 0.0) == []  # held: its requests are not known yet
    del frame
peak = status("VmHWM") - base
replies = core.tick(2.0)  # C1: destinations never came; every READY is answered
assert len(replies) == frames and not core.has_waiting_reads(), replies
del replies
gc.collect()
print(json.dumps({"bytes": sent, "peak": peak, "after": status("VmRSS") - base,
                  "entries": n_entries}))
"""


def ready_memory(frames: int = 3, frame_bytes: int = wire.MAX_FRAME_BYTES) -> dict[str, int]:
    """Peak RSS growth of a Decode core holding ``frames`` READYs of about ``frame_bytes``
    each (1-byte ids) and its RSS growth once they are answered, measured in a child
    process: ``{"bytes", "peak", "after", "entries"}`` in bytes."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _READY_MEMORY_CHILD, str(frames),
                          str(frame_bytes)], capture_output=True, text=True, check=False,
                         timeout=300)
    if out.returncode:
        raise BenchError(f"ready_peak_rss: the child process failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def bench_ready_memory(sizes: Sizes) -> Result:
    """``ready_peak_rss_ratio``: peak RSS growth over the bytes of the READYs in flight."""
    mem = ready_memory()
    return Result(
        "ready_peak_rss", mem["peak"], mem["bytes"], "MiB", 1 / (1 << 20),
        f"3 READYs of {mem['bytes'] // 3 >> 20} MiB (1-byte ids) held by a Decode core; "
        "peak RSS growth vs the bytes in flight",
        {"verified": True, "after_bytes": mem["after"], "entries_per_frame": mem["entries"]})
