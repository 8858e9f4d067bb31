"""Raw RD2H peers for the interop matrix: the upstream vllm-ascend connector, the
zhenwenqi2024 fork and the predecessor connector, written in plain pyzmq + msgpack from their
wire facts.

Nothing here imports the project's control plane (``sfa_rd2h.spec``, ``statemachines``,
``runtime.control``): a raw peer that shared the project's codec or block arithmetic would
agree with the project by construction and prove nothing. Only the data plane is shared:
the peers register memory and read through the project's ``HostEngine``, exactly as an
upstream deployment would use the same transfer engine.

Besides the peers, this module holds the test scenario both sides run (source memory filled
with per-block patterns, the shared main destination pool and the per-rank indexer copies)
and the oracle that says which destination block must hold which source bytes after a run.

Wire facts used (upstream unless noted):

* every frame is a msgpack array, ``use_bin_type=True``: message kinds are bin, strings str;
* ``[b"mf_meta", p_session, layer_map_blob]`` -> raw single frame ``b"ACK"``; upstream Decode
  reads only the first three fields;
* fork: ``[b"mf_meta", p_session, blob, 1, pp_rank, pp_size]`` -> exactly
  ``msgpack.packb([b"mf_meta_ack", 1])``; a 3-field MF_META -> ``b"ACK"``; any other length
  makes the fork Decode raise without replying;
* ``[b"read_ready_batch", layer_idx, layer_name, read_reqs, done_ext_ids, member, ratio]``,
  entries ``[ext_id, p_main_ids, p_indexer_ids, main_dest_start, indexer_dest_start]``;
  replies ``[b"read_done", layer_idx]`` / ``[b"read_failed", layer_idx, error]``;
* Prefill sends every contributor the FULL chunk lists; Decode cuts (see :func:`sub_range`).
"""

from __future__ import annotations

import functools
import itertools
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from sfa_rd2h.runtime.engines.host import HostEngine

MF_META = b"mf_meta"
MF_META_ACK = b"mf_meta_ack"
READ_READY_BATCH = b"read_ready_batch"
READ_DONE = b"read_done"
READ_FAILED = b"read_failed"
RAW_ACK = b"ACK"
SFAPD_PROTOCOL_VERSION = 1  # the fork's handshake version

PREFILL_FLAVORS = ("upstream", "fork", "predecessor")
DECODE_FLAVORS = ("upstream", "fork")

# Layer-map keys in the order the public connector writes them; the predecessor knew three.
FULL_KEYS = ("base_addrs", "block_len", "block_size_scale", "tensor_group_idx",
             "main_tensor_count", "has_indexer")
PREDECESSOR_KEYS = ("base_addrs", "block_len", "tensor_group_idx")

# --------------------------------------------------------------------------- scenario

BLOCK_TOKENS = 4
# (name, bytes per block). Every tensor has a different block size, so a descriptor built
# for the wrong tensor lands on a wrong offset and the byte check sees it.
TENSORS = (("k", 64), ("v", 48), ("indexer", 32), ("scale", 8))
MAIN_TENSORS = 2  # K and V; then the indexer key, then its LIC8 scale
GROUP_IDX = (0, 0, 1, 1)
SRC_BLOCKS = 16  # blocks per tensor in one Prefill slot
DST_BLOCKS = 24  # blocks per tensor in one Decode destination buffer


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    # raw=False: msgpack str -> str, bin -> bytes, so kinds stay bytes as they were sent.
    return msgpack.unpackb(frame, raw=False)


def sub_range(n: int, rank: int, size: int, start: int) -> tuple[int, int]:
    """``(begin, count)`` of the part of an ``n``-block list that ``rank`` of ``size`` owns.

    The upstream Decode's rule: the piece order is rotated by the entry's destination start,
    so the ranks that get the one extra block change from chunk to chunk.
    """
    logical = (rank - start % size) % size
    q, rem = divmod(n, size)
    return logical * q + min(logical, rem), q + (1 if logical < rem else 0)


@dataclass(frozen=True)
class Request:
    ext_id: str
    index: int  # seeds the request's byte patterns
    p_main: tuple[int, ...]  # Prefill source block per position (main K/V)
    p_indexer: tuple[int, ...]  # Prefill source block per position (indexer, scale)
    d_main: tuple[int, ...]  # destination in the shared main pool, per position
    d_indexer: tuple[int, ...]  # destination in each Decode rank's indexer copy


@dataclass(frozen=True)
class Chunk:
    ext_id: str
    start: int  # block positions [start, stop) of the request
    stop: int
    final: bool


@dataclass(frozen=True)
class Workload:
    n_layers: int
    n_slots: int  # Prefill reuses n_slots physical buffers for n_layers layers
    requests: tuple[Request, ...]
    steps: tuple[tuple[Chunk, ...], ...]  # one READY per layer per step

    def request(self, ext_id: str) -> Request:
        return next(r for r in self.requests if r.ext_id == ext_id)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn" for i in range(self.n_layers))


def default_workload() -> Workload:
    """Three requests, chunked, over three layers on two slots.

    ``req-a``: 4 blocks in one chunk; ``req-b``: 7 blocks in chunks of 3 + 4 (the second
    chunk starts at position 3, so every cut is rotated); ``req-c``: 1 block alone in the
    last step, so with two contributors or two Decode ranks someone owns nothing and must
    still answer READ_DONE (T4). Block ids are scattered and differ between main and
    indexer, so confusing the two lists or the source and destination ids shows up.
    """
    requests = (
        Request("req-a", 0, (9, 3, 5, 12), (2, 4, 6, 8), (5, 6, 7, 8), (1, 2, 3, 4)),
        Request("req-b", 1, (0, 1, 2, 7, 10, 11, 13), (1, 3, 5, 7, 9, 10, 11),
                (14, 3, 15, 16, 0, 17, 18), (10, 11, 12, 13, 20, 21, 22)),
        Request("req-c", 2, (15,), (14,), (23,), (0,)),
    )
    steps = (
        (Chunk("req-a", 0, 4, True), Chunk("req-b", 0, 3, False)),
        (Chunk("req-b", 3, 7, True),),
        (Chunk("req-c", 0, 1, True),),
    )
    return Workload(3, 2, requests, steps)


@functools.lru_cache(maxsize=4096)
def block_pattern(req: int, layer: int, tensor: int, pos: int, p_rank: int) -> np.ndarray:
    """The bytes Prefill rank ``p_rank`` holds for one block; never zero, seeded by crc32.

    The Prefill rank is part of the key although real ranks hold replicated KV: it makes
    the destination bytes say which contributor moved them, so a Decode that pulls main from
    member 1, or an indexer piece from the wrong member, fails the byte check.
    """
    seed = zlib.crc32(f"{req}/{layer}/{tensor}/{pos}/{p_rank}".encode())
    block = np.random.default_rng(seed).integers(1, 256, TENSORS[tensor][1], dtype=np.uint8)
    block.flags.writeable = False
    return block


def _register(engine: HostEngine, arrays: Iterable[np.ndarray]) -> None:
    for a in arrays:
        engine.register_memory(a.ctypes.data, a.nbytes)


class PrefillMemory:
    """One Prefill rank's engine and its ``n_slots`` physical layer buffers."""

    def __init__(self, p_rank: int, workload: Workload) -> None:
        self.p_rank = p_rank
        self.workload = workload
        self.engine = HostEngine()
        self.engine.initialize()
        self.slots = [[np.zeros((SRC_BLOCKS, nb), np.uint8) for _, nb in TENSORS]
                      for _ in range(workload.n_slots)]
        _register(self.engine, itertools.chain.from_iterable(self.slots))

    @property
    def session(self) -> str:
        return self.engine.session_id

    def layer_fields(self, layer: int) -> dict[str, Any]:
        slot = self.slots[layer % self.workload.n_slots]
        return {
            "base_addrs": [int(a.ctypes.data) for a in slot],
            "block_len": [nb for _, nb in TENSORS],
            "block_size_scale": [1] * len(TENSORS),
            "tensor_group_idx": list(GROUP_IDX),
            "main_tensor_count": MAIN_TENSORS,
            "has_indexer": True,
        }

    def layer_map(self, keys: Sequence[str] = FULL_KEYS) -> dict[str, dict[str, Any]]:
        """The MF_META layer map, limited to ``keys`` (the predecessor sent three)."""
        out = {}
        for i, name in enumerate(self.workload.layer_names):
            fields = self.layer_fields(i)
            out[name] = {k: fields[k] for k in keys}
        return out

    def write_layer(self, layer: int, chunks: Iterable[Chunk]) -> None:
        """The layer's KV scatter for this step: every position of every chunk."""
        slot = self.slots[layer % self.workload.n_slots]
        for chunk in chunks:
            req = self.workload.request(chunk.ext_id)
            for pos in range(chunk.start, chunk.stop):
                for t, arr in enumerate(slot):
                    ids = req.p_main if t < MAIN_TENSORS else req.p_indexer
                    arr[ids[pos]] = block_pattern(req.index, layer, t, pos, self.p_rank)

    def close(self) -> None:
        self.engine.close()


class CountingHostEngine(HostEngine):
    """A HostEngine that remembers where every successful read wrote, so a test can count
    writes per destination byte (a block written twice or by the wrong rank shows up even
    when the bytes happen to be right)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._writes_lock = threading.Lock()
        self.writes: list[tuple[np.ndarray, np.ndarray]] = []  # (local addrs, lengths)

    def batch_transfer_sync_read(self, session: str, local_addrs: Any, peer_addrs: Any,
                                 lengths: Any) -> int:
        result = super().batch_transfer_sync_read(session, local_addrs, peer_addrs, lengths)
        if result == 0:
            local = np.array(local_addrs, dtype=np.uint64).reshape(-1)
            n = np.array(lengths, dtype=np.uint64).reshape(-1)
            with self._writes_lock:
                self.writes.append((local, n))
        return result


@dataclass(frozen=True)
class TensorDest:
    base: int
    block_bytes: int
    num_blocks: int


@dataclass
class RankDest:
    """What one Decode rank registered: its engine and, per layer name, K, V (in the shared
    pool), indexer and scale (its own copy)."""

    d_rank: int
    engine: CountingHostEngine
    layers: dict[str, tuple[TensorDest, ...]]


class DecodeMemory:
    """One Decode instance: a main pool SHARED by the D TP ranks (one K and one V buffer per
    layer, registered by every rank, as upstream's Ascend CPU pool) and per-rank indexer and
    scale buffers. Every buffer starts zeroed; patterns are never all-zero blocks."""

    def __init__(self, d_tp: int, workload: Workload) -> None:
        self.d_tp = d_tp
        self.workload = workload
        self.main = [[np.zeros((DST_BLOCKS, nb), np.uint8) for _, nb in TENSORS[:MAIN_TENSORS]]
                     for _ in range(workload.n_layers)]
        self.indexer = [[[np.zeros((DST_BLOCKS, nb), np.uint8)
                          for _, nb in TENSORS[MAIN_TENSORS:]]
                         for _ in range(workload.n_layers)] for _ in range(d_tp)]
        self.engines: list[CountingHostEngine] = []
        for rank in range(d_tp):
            engine = CountingHostEngine()
            self.engines.append(engine)
            engine.initialize()
            _register(engine, itertools.chain.from_iterable(self.main))
            _register(engine, itertools.chain.from_iterable(self.indexer[rank]))

    def tensors(self, rank: int, layer: int) -> list[np.ndarray]:
        return [*self.main[layer], *self.indexer[rank][layer]]

    def rank(self, rank: int) -> RankDest:
        layers = {
            name: tuple(TensorDest(int(a.ctypes.data), a.shape[1], a.shape[0])
                        for a in self.tensors(rank, i))
            for i, name in enumerate(self.workload.layer_names)
        }
        return RankDest(rank, self.engines[rank], layers)

    def buffers(self) -> dict[str, np.ndarray]:
        """Every destination buffer by a readable name (the main ones once: they are shared)."""
        out = {}
        for layer in range(self.workload.n_layers):
            for t, a in enumerate(self.main[layer]):
                out[f"main L{layer} {TENSORS[t][0]}"] = a
            for rank in range(self.d_tp):
                for j, a in enumerate(self.indexer[rank][layer]):
                    out[f"d{rank} L{layer} {TENSORS[MAIN_TENSORS + j][0]}"] = a
        return out

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


# --------------------------------------------------------------------------- oracle


def expected_blocks(workload: Workload, p_tp: int,
                    d_tp: int) -> dict[str, dict[int, tuple[int, int, int, int]]]:
    """Buffer name -> destination block -> (request, layer, position, source p_rank).

    Derived from the cut rules alone: in the shared pool, Decode rank r's main part of a
    chunk comes from its group's member 0; indexer piece m of a chunk from member m.
    Checked to cover every position of every chunk exactly once per destination.
    """
    ratio = p_tp // d_tp
    out: dict[str, dict[int, tuple[int, int, int, int]]] = {}

    def put(name: str, block: int, value: tuple[int, int, int, int]) -> None:
        slot = out.setdefault(name, {})
        assert block not in slot, f"oracle: {name} block {block} assigned twice"
        slot[block] = value

    for layer in range(workload.n_layers):
        for chunk in itertools.chain.from_iterable(workload.steps):
            req = workload.request(chunk.ext_id)
            n = chunk.stop - chunk.start
            main_owned = Counter()
            for r in range(d_tp):
                begin, count = sub_range(n, r, d_tp, chunk.start)
                for pos in range(chunk.start + begin, chunk.start + begin + count):
                    main_owned[pos] += 1
                    for t in range(MAIN_TENSORS):
                        put(f"main L{layer} {TENSORS[t][0]}", req.d_main[pos],
                            (req.index, layer, pos, r * ratio))
                idx_owned = Counter()
                for m in range(ratio):
                    begin, count = sub_range(n, m, ratio, chunk.start)
                    for pos in range(chunk.start + begin, chunk.start + begin + count):
                        idx_owned[pos] += 1
                        for t in range(MAIN_TENSORS, len(TENSORS)):
                            put(f"d{r} L{layer} {TENSORS[t][0]}", req.d_indexer[pos],
                                (req.index, layer, pos, r * ratio + m))
                assert idx_owned == Counter(range(chunk.start, chunk.stop)), "oracle: indexer"
            assert main_owned == Counter(range(chunk.start, chunk.stop)), "oracle: main"
    return out


@dataclass
class Verification:
    bytes_checked: int = 0  # every byte of every destination buffer
    bytes_expected: int = 0  # bytes that must hold a pattern (the rest must stay zero)
    bytes_written: int = 0  # what the engines report writing
    problems: list[str] = field(default_factory=list)


def _tensor_of(name: str) -> int:
    return [t for t, _ in TENSORS].index(name.rsplit(" ", 1)[1])


def verify(memory: DecodeMemory, p_tp: int) -> Verification:
    """Compare every destination byte with the oracle and count writes per byte.

    A block must end equal to its pattern and be written exactly once (in the shared pool:
    once over all Decode ranks); every other block must stay zero and unwritten.
    """
    workload = memory.workload
    expect = expected_blocks(workload, p_tp, memory.d_tp)
    buffers = memory.buffers()
    res = Verification()
    # Per-byte write counts from the engines' descriptors (difference arrays, then cumsum).
    diffs = {name: np.zeros(a.nbytes + 1, np.int64) for name, a in buffers.items()}
    spans = sorted((int(a.ctypes.data), a.nbytes, name) for name, a in buffers.items())
    for rank, engine in enumerate(memory.engines):
        for local, lengths in engine.writes:
            for addr, n in zip(local.tolist(), lengths.tolist(), strict=True):
                res.bytes_written += n
                # A coalesced descriptor may in principle run across two adjacent
                # buffers, so it is split over every buffer it overlaps.
                covered = 0
                for base, size, name in spans:
                    lo, hi = max(addr, base), min(addr + n, base + size)
                    if lo < hi:
                        diffs[name][lo - base] += 1
                        diffs[name][hi - base] -= 1
                        covered += hi - lo
                if covered != n:
                    res.problems.append(f"d{rank} wrote {n - covered} of [{addr:#x}, +{n}) "
                                        "outside every destination buffer")
    for name, arr in buffers.items():
        res.bytes_checked += arr.nbytes
        t = _tensor_of(name)
        counts = np.cumsum(diffs[name])[:-1].reshape(arr.shape)
        want = np.zeros_like(arr)
        for block, (req, layer, pos, p_rank) in expect.get(name, {}).items():
            want[block] = block_pattern(req, layer, t, pos, p_rank)
            res.bytes_expected += arr.shape[1]
        for block in range(arr.shape[0]):
            wanted = expect.get(name, {}).get(block)
            writes = set(counts[block].tolist())
            if wanted is None:
                if arr[block].any() or writes != {0}:
                    res.problems.append(f"{name} block {block}: must stay untouched, got "
                                        f"{int(arr[block].astype(bool).sum())} non-zero bytes, "
                                        f"writes {sorted(writes)}")
                continue
            if not np.array_equal(arr[block], want[block]):
                what = "never written (all zero)" if not arr[block].any() else "wrong bytes"
                src = _who_wrote(arr[block], wanted, t, expect_from=p_tp)
                res.problems.append(f"{name} block {block} (req {wanted[0]} pos {wanted[2]} "
                                    f"from p{wanted[3]}): {what}{src}")
            elif writes != {1}:
                res.problems.append(f"{name} block {block} (req {wanted[0]} pos {wanted[2]}): "
                                    f"right bytes but written {sorted(writes)} time(s)")
    return res


def _who_wrote(got: np.ndarray, wanted: tuple[int, int, int, int], tensor: int,
               expect_from: int) -> str:
    """Name the contributor whose bytes landed instead, when the block is one of theirs."""
    req, layer, pos, _ = wanted
    for p in range(expect_from):
        if np.array_equal(got, block_pattern(req, layer, tensor, pos, p)):
            return f"; it holds p{p}'s copy"
    return ""


# --------------------------------------------------------------------------- sockets


def _payload(frames: Sequence[bytes]) -> bytes | None:
    """The one non-empty frame of a DEALER-side message (delimiters are dropped)."""
    parts = [f for f in frames if f]
    return parts[0] if len(parts) == 1 else None


class _Stopper:
    """An inproc PAIR so another thread can wake a poll loop to stop, without timeouts."""

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context) -> None:
        addr = f"inproc://interop-stop-{next(self._ids)}"
        self.rx = ctx.socket(zmq.PAIR)
        self.rx.bind(addr)
        self.tx = ctx.socket(zmq.PAIR)
        self.tx.connect(addr)

    def close(self) -> None:
        self.rx.close(linger=0)
        self.tx.close(linger=0)


# --------------------------------------------------------------------------- raw Prefill


@dataclass
class Reply:
    layer: int | None
    kind: str  # "read_done", "read_failed" or "unexpected"
    error: str = ""
    matched: bool = True  # False: no READY for that layer was outstanding (duplicate, stray)
    raw: bytes = b""


@dataclass
class PrefillReport:
    flavor: str
    p_rank: int
    meta_fields: int = 0
    handshake_reply: bytes | None = None
    handshake_ok: bool = False
    handshake_seconds: float | None = None
    readies: list[int] = field(default_factory=list)  # layer of every READY sent, in order
    replies: list[Reply] = field(default_factory=list)
    error: str | None = None  # why the run stopped early
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def unanswered(self) -> int:
        return len(self.readies) - sum(r.matched for r in self.replies)

    def failures(self) -> list[str]:
        return [f"L{r.layer}: {r.error}" for r in self.replies if r.kind == "read_failed"]

    def problems(self) -> list[str]:
        out = [f"p{self.p_rank}: {self.error}"] if self.error else []
        out += [f"p{self.p_rank}: READ_FAILED {f}" for f in self.failures()]
        out += [f"p{self.p_rank}: reply matches no READY: {r.kind} layer {r.layer} "
                f"{r.raw[:60]!r}" for r in self.replies if not r.matched]
        if self.unanswered and not self.error:
            out.append(f"p{self.p_rank}: {self.unanswered} READY(s) unanswered")
        return out


class RawPrefill:
    """One raw Prefill rank of an earlier connector, speaking its own handshake.

    ``flavor``: ``upstream`` (3-field MF_META, expects raw ACK), ``fork`` (6-field MF_META
    with ``pp_rank``/``pp_size``, expects ``[b"mf_meta_ack", 1]``, or raw ACK when
    ``pp_size`` is 1) or ``predecessor`` (3-field MF_META whose layer map has only the three
    keys it knew, expects raw ACK). Every flavor sends the 7-field READY with the FULL chunk
    lists (T6) and ``main_dest_start = indexer_dest_start = chunk start``.

    Like the real connector it pipelines: a layer's READY goes out as soon as the layer is
    written, and a slot is only rewritten once the READY of its previous layer was answered
    (S1). Replies are awaited with one deadline for the whole run.
    """

    def __init__(self, flavor: str, p_rank: int, p_tp: int, d_tp: int, host: str,
                 base_port: int, memory: PrefillMemory, workload: Workload, *,
                 timeout: float = 3.0, pp_rank: int = 0, pp_size: int = 1,
                 version: int = SFAPD_PROTOCOL_VERSION,
                 layer_map: Mapping[str, Any] | None = None) -> None:
        if flavor not in PREFILL_FLAVORS:
            raise ValueError(f"unknown Prefill flavor {flavor!r}")
        self.flavor = flavor
        self.p_rank = p_rank
        self.ratio = p_tp // d_tp
        self.d_rank = p_rank // self.ratio
        self.member = p_rank % self.ratio
        self.endpoint = f"tcp://{host}:{base_port + self.d_rank}"
        self.memory = memory
        self.workload = workload
        self.timeout = timeout
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.version = version
        if layer_map is None:
            keys = PREDECESSOR_KEYS if flavor == "predecessor" else FULL_KEYS
            layer_map = memory.layer_map(keys)
        self.layer_map = dict(layer_map)
        self.report = PrefillReport(flavor, p_rank)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._outstanding: Counter[int] = Counter()
        self._deadline = 0.0

    # -- frames
    def meta_frame(self) -> bytes:
        blob = pack(self.layer_map)
        fields: list[Any] = [MF_META, self.memory.session, blob]
        if self.flavor == "fork":
            fields += [self.version, self.pp_rank, self.pp_size]
        self.report.meta_fields = len(fields)
        return pack(fields)

    def ready_frame(self, layer: int, chunks: Sequence[Chunk]) -> bytes:
        entries = []
        done = []
        for c in chunks:
            req = self.workload.request(c.ext_id)
            entries.append([c.ext_id, list(req.p_main[c.start:c.stop]),
                            list(req.p_indexer[c.start:c.stop]), c.start, c.start])
            if c.final and layer == self.workload.n_layers - 1:
                done.append(c.ext_id)
        return pack([READ_READY_BATCH, layer, self.workload.layer_names[layer], entries, done,
                     self.member, self.ratio])

    def accepts(self, reply: bytes) -> bool:
        """Whether this flavor accepts ``reply`` to its MF_META."""
        if self.flavor != "fork":
            return reply == RAW_ACK
        if reply == RAW_ACK:
            return self.pp_size == 1
        try:
            return unpack(reply) == [MF_META_ACK, self.version]
        except Exception:  # noqa: BLE001 - anything undecodable is simply not accepted
            return False

    # -- socket
    def connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"raw-{self.flavor}-p{self.p_rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock

    def send(self, payload: bytes) -> None:
        assert self._sock is not None
        self._sock.send(payload)

    def recv(self, deadline: float) -> bytes | None:
        """The next payload frame before ``deadline`` (monotonic), or None."""
        assert self._sock is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000))):
            return None
        frames = self._sock.recv_multipart()
        payload = _payload(frames)
        return payload if payload is not None else b"".join(frames)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    # -- protocol
    def handshake(self, deadline: float | None = None) -> bool:
        """Send MF_META and judge the reply; fails fast on anything the flavor rejects."""
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        t0 = time.monotonic()
        self.send(self.meta_frame())
        reply = self.recv(deadline)
        self.report.handshake_seconds = time.monotonic() - t0
        self.report.handshake_reply = reply
        if reply is None:
            self.report.timed_out = True
            self.report.error = f"no reply to MF_META within {self.timeout}s"
            return False
        self.report.handshake_ok = self.accepts(reply)
        if not self.report.handshake_ok:
            self.report.error = f"{self.flavor} Prefill rejects handshake reply {_show(reply)}"
        return self.report.handshake_ok

    def _take_reply(self) -> bool:
        """Receive one reply and match it to an outstanding READY; False on deadline."""
        frame = self.recv(self._deadline)
        if frame is None:
            self.report.timed_out = True
            self.report.error = (f"{sum(self._outstanding.values())} READY(s) unanswered "
                                 f"after {self.timeout}s (layers "
                                 f"{sorted(+self._outstanding)})")
            return False
        try:
            msg = unpack(frame)
            kind, layer = msg[0], msg[1]
        except Exception:  # noqa: BLE001 - recorded as what it is
            self.report.replies.append(Reply(None, "unexpected", matched=False, raw=frame))
            return True
        if kind not in (READ_DONE, READ_FAILED) or type(layer) is not int:
            self.report.replies.append(Reply(None, "unexpected", matched=False, raw=frame))
            return True
        matched = self._outstanding[layer] > 0
        if matched:
            self._outstanding[layer] -= 1
        error = str(msg[2]) if kind == READ_FAILED and len(msg) > 2 else ""
        self.report.replies.append(Reply(layer, kind.decode(), error, matched, frame))
        return True

    def _await_layer(self, layer: int) -> bool:
        while self._outstanding[layer] > 0:
            if not self._take_reply():
                return False
        return True

    def run(self) -> PrefillReport:
        """Handshake, then every step's READYs (one per layer), then await every reply."""
        t0 = time.monotonic()
        self._deadline = t0 + self.timeout
        try:
            self.connect()
            if not self.handshake(self._deadline):
                return self.report
            last_user: dict[int, int] = {}  # slot -> layer whose READY used it last
            for chunks in self.workload.steps:
                for layer in range(self.workload.n_layers):
                    slot = layer % self.workload.n_slots
                    # S1: the slot's previous READY must be answered before it is rewritten.
                    if slot in last_user and not self._await_layer(last_user[slot]):
                        return self.report
                    self.memory.write_layer(layer, chunks)
                    self.send(self.ready_frame(layer, chunks))
                    self.report.readies.append(layer)
                    self._outstanding[layer] += 1
                    last_user[slot] = layer
            while +self._outstanding:
                if not self._take_reply():
                    return self.report
            return self.report
        finally:
            self.report.seconds = time.monotonic() - t0
            self.close()


def describe_reply(frame: bytes | None) -> str:
    """A handshake reply in a few characters: ``ACK``, ``[mf_meta_ack, 1]``, ``silence``."""
    if frame is None:
        return "silence"
    if frame == RAW_ACK:
        return "ACK"
    try:
        msg = unpack(frame)
    except Exception:  # noqa: BLE001 - not msgpack
        return repr(frame[:20])
    if isinstance(msg, list):
        # Kind, flag and version say what the reply is; error texts go in the cell detail.
        parts = [m.decode() if isinstance(m, bytes) else repr(m)[:40] for m in msg[:3]]
        return "[" + ", ".join(parts) + (", ...]" if len(msg) > 3 else "]")
    return repr(msg)[:40]


def _show(frame: bytes) -> str:
    try:
        return repr(unpack(frame))[:200]
    except Exception:  # noqa: BLE001 - not msgpack: show the raw bytes
        return repr(frame[:200])


# --------------------------------------------------------------------------- raw Decode


class CutError(Exception):
    """A READY this Decode cannot serve; becomes READ_FAILED for the layer."""


@dataclass
class Handshake:
    peer: bytes
    fields: int
    reply: bytes | None  # None: no reply sent (the fork's raise)
    session: str = ""


@dataclass
class DecodeReport:
    flavor: str
    d_rank: int
    handshakes: list[Handshake] = field(default_factory=list)
    readies: int = 0
    replies: Counter[str] = field(default_factory=Counter)  # kind -> count
    failures: list[str] = field(default_factory=list)  # READ_FAILED texts
    errors: list[str] = field(default_factory=list)  # frames it could not handle
    crash: str | None = None


@dataclass
class _Layer:
    """One layer of a peer's MF_META after upstream's defaults were filled in."""

    base_addrs: list[int]
    block_bytes: list[int]  # block_len * block_size_scale
    main_tensor_count: int
    has_indexer: bool


@dataclass
class _Peer:
    session: str
    layers: dict[str, _Layer]


def parse_layer_map(blob: bytes) -> dict[str, _Layer]:
    """Upstream Decode's reading of the MF_META blob, defaults included: block_size_scale
    all 1, main_tensor_count 2, has_indexer when there are more addresses than main tensors
    (so a predecessor's three-key map still works)."""
    layers = {}
    for name, m in unpack(blob).items():
        addrs = [int(a) for a in m["base_addrs"]]
        lens = [int(b) for b in m["block_len"]]
        scale = [int(s) for s in m.get("block_size_scale", [1] * len(addrs))]
        main = int(m.get("main_tensor_count", 2))
        has_indexer = bool(m.get("has_indexer", len(addrs) > main))
        if not len(addrs) == len(lens) == len(scale):
            raise CutError(f"layer {name!r}: per-tensor lists differ in length")
        layers[name] = _Layer(addrs, [b * s for b, s in zip(lens, scale, strict=True)], main,
                              has_indexer)
    return layers


class RawDecode:
    """One raw Decode rank (``upstream`` or ``fork``): binds a ROUTER, answers the
    handshake as its flavor does, cuts every READY with the upstream rules (main destination
    in the shared pool), reads with the host engine and replies once per READY."""

    def __init__(self, flavor: str, d_rank: int, d_tp: int, port: int, dest: RankDest,
                 registrations: Mapping[str, tuple[Sequence[int], Sequence[int]]], *,
                 host: str = "127.0.0.1") -> None:
        if flavor not in DECODE_FLAVORS:
            raise ValueError(f"unknown Decode flavor {flavor!r}")
        self.flavor = flavor
        self.d_rank = d_rank
        self.d_tp = d_tp
        self.dest = dest
        self.registrations = {k: (tuple(m), tuple(i)) for k, (m, i) in registrations.items()}
        self.report = DecodeReport(flavor, d_rank)
        self._peers: dict[bytes, _Peer] = {}
        self._finals: dict[str, set[int]] = {}
        self._ratio: dict[str, int] = {}
        self._failed: dict[str, str] = {}
        self._cond = threading.Condition()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            self._router.close(linger=0)
            self._ctx.term()
            raise
        self.port = port
        self._stop = _Stopper(self._ctx)
        self._thread = threading.Thread(target=self._run, name=f"raw-decode{d_rank}",
                                        daemon=True)
        self._thread.start()

    # -- completion
    def outcome(self, ext_id: str) -> bool | None:
        """True once every member of the group sent its final and all reads succeeded;
        False once a read for it failed; None while pending."""
        with self._cond:
            return self._outcome(ext_id)

    def _outcome(self, ext_id: str) -> bool | None:
        if ext_id in self._failed:
            return False
        ratio = self._ratio.get(ext_id)
        if ratio is not None and self._finals.get(ext_id) == set(range(ratio)):
            return True
        return None

    def wait_outcomes(self, ext_ids: Iterable[str], timeout: float) -> dict[str, bool | None]:
        ids = list(ext_ids)
        with self._cond:
            self._cond.wait_for(lambda: all(self._outcome(e) is not None for e in ids), timeout)
            return {e: self._outcome(e) for e in ids}

    # -- loop
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._stop.rx, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._stop.rx in events:
                    return
                if self._router in events:
                    self._handle(self._router.recv_multipart())
        except Exception as exc:  # noqa: BLE001 - surfaced through the report
            self.report.crash = f"{type(exc).__name__}: {exc}"
        finally:
            self._router.close(linger=0)

    def close(self) -> None:
        self._stop.tx.send(b"")
        self._thread.join(5.0)
        alive = self._thread.is_alive()
        self._stop.close()
        if not alive:
            self._ctx.term()
        assert not alive, f"raw decode {self.d_rank} did not stop"

    def _reply(self, identity: bytes, delimited: bool, payload: bytes) -> None:
        self._router.send_multipart([identity, b"", payload] if delimited
                                    else [identity, payload])

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and frames[1] == b"":
            identity, payload, delimited = frames[0], frames[2], True
        elif len(frames) == 2:
            identity, payload, delimited = frames[0], frames[1], False
        else:
            self.report.errors.append(f"bad framing: {len(frames)} frames")
            return
        try:
            msg = unpack(payload)
            kind = msg[0]
        except Exception as exc:  # noqa: BLE001 - the real connector would just log it
            self.report.errors.append(f"undecodable frame: {exc}")
            return
        if kind == MF_META:
            self._on_meta(identity, delimited, msg)
        elif kind == READ_READY_BATCH:
            reply, owned = self._on_ready(identity, msg)
            for payload in self._replies(reply, owned):
                self._reply(identity, delimited, payload)
        else:
            self.report.errors.append(f"unknown kind {kind!r}")

    def _on_meta(self, identity: bytes, delimited: bool, msg: list[Any]) -> None:
        n = len(msg)
        if self.flavor == "fork" and n not in (3, 6):
            # The fork's handler raises on any other length: no reply at all.
            self.report.handshakes.append(Handshake(identity, n, None))
            self.report.errors.append(f"fork decode raised: MF_META with {n} fields")
            return
        if n < 3:
            self.report.handshakes.append(Handshake(identity, n, None))
            self.report.errors.append(f"MF_META with {n} fields")
            return
        try:
            # Upstream reads only the first three fields, whatever follows.
            self._peers[identity] = _Peer(str(msg[1]), parse_layer_map(msg[2]))
        except Exception as exc:  # noqa: BLE001 - upstream would raise in its handler
            self.report.handshakes.append(Handshake(identity, n, None, str(msg[1])))
            self.report.errors.append(f"layer map unusable: {exc}")
            return
        reply = pack([MF_META_ACK, SFAPD_PROTOCOL_VERSION]) if (
            self.flavor == "fork" and n == 6) else RAW_ACK
        self.report.handshakes.append(Handshake(identity, n, reply, str(msg[1])))
        self._reply(identity, delimited, reply)

    def _on_ready(self, identity: bytes, msg: list[Any]) -> tuple[bytes, int]:
        """Serve one READY; returns the reply and how many descriptors this rank read."""
        self.report.readies += 1
        layer_idx = msg[1] if len(msg) > 1 else None
        ext_ids = []
        try:
            if len(msg) < 5:
                raise CutError(f"READY with {len(msg)} fields")
            _, layer_idx, name, entries, done = msg[:5]
            member, ratio = (msg[5], msg[6]) if len(msg) >= 7 else (0, 1)
            ext_ids = [e[0] for e in entries]
            peer = self._peers.get(identity)
            if peer is None:
                raise CutError("READY before MF_META on this connection")
            local, remote, lengths = self._cut(peer, name, entries, member, ratio)
            owned = len(lengths)
            if lengths:
                result = self.dest.engine.batch_transfer_sync_read(
                    peer.session, local, remote, lengths)
                if result != 0:
                    raise CutError(f"read failed ({result}): {self.dest.engine.last_error}")
        except CutError as exc:
            error = f"raw {self.flavor} decode {self.d_rank}: {exc}"
            with self._cond:
                for ext in ext_ids:
                    self._failed.setdefault(ext, error)
                self._cond.notify_all()
            self.report.replies["read_failed"] += 1
            self.report.failures.append(error)
            return pack([READ_FAILED, layer_idx, error]), 0
        with self._cond:
            for ext in done:
                self._finals.setdefault(ext, set()).add(member)
                self._ratio[ext] = ratio
            self._cond.notify_all()
        self.report.replies["read_done"] += 1
        return pack([READ_DONE, layer_idx]), owned

    # Hooks: the negative controls in test_interop override one each to put a known bug
    # back, and the checks must catch it.
    def _pulls_main(self, member: int) -> bool:
        return member == 0  # T2

    def _main_part(self, n: int, main_start: int) -> tuple[int, int]:
        return sub_range(n, self.d_rank, self.d_tp, main_start)  # T5, shared pool

    def _indexer_part(self, n: int, member: int, ratio: int, start: int) -> tuple[int, int]:
        return sub_range(n, member, ratio, start) if ratio > 1 else (0, n)  # T3

    def _replies(self, reply: bytes, owned: int) -> list[bytes]:
        return [reply]  # S3: exactly one, also when this rank owned nothing (T4)

    def _cut(self, peer: _Peer, name: str, entries: list[Any], member: int,
             ratio: int) -> tuple[list[int], list[int], list[int]]:
        """This rank's descriptors for a READY, cut by the upstream rules (T2, T3, T5)."""
        src = peer.layers.get(name)
        dst = self.dest.layers.get(name)
        if src is None or dst is None:
            raise CutError(f"layer {name!r} unknown")
        if (len(src.base_addrs) != len(dst) or src.main_tensor_count != MAIN_TENSORS
                or not src.has_indexer
                or src.block_bytes != [d.block_bytes for d in dst]):
            raise CutError(f"layer {name!r}: source layout does not match the destination")
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []

        def add(tensors: range, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
            for t in tensors:
                nb = dst[t].block_bytes
                for s, d in zip(src_ids, dst_ids, strict=True):
                    if not 0 <= d < dst[t].num_blocks:
                        raise CutError(f"destination block {d} outside tensor {t}")
                    local.append(dst[t].base + d * nb)
                    remote.append(src.base_addrs[t] + s * nb)
                    lengths.append(nb)

        for ext, p_main, p_idx, main_start, idx_start in (e[:5] for e in entries):
            reg = self.registrations.get(ext)
            if reg is None:
                raise CutError(f"request {ext!r} is not registered")
            d_main, d_idx = reg
            if not p_main and not p_idx:
                raise CutError(f"entry for {ext!r} has neither main nor indexer blocks")
            if self._pulls_main(member) and p_main:  # T2: only member 0 pulls main
                n = len(p_main)
                if main_start + n > len(d_main):
                    raise CutError(f"main range [{main_start}, {main_start + n}) outside "
                                   f"{len(d_main)} destination blocks of {ext!r}")
                # T5, shared pool: this D rank takes its part of the chunk.
                b, c = self._main_part(n, main_start)
                add(range(MAIN_TENSORS), p_main[b:b + c],
                    d_main[main_start + b:main_start + b + c])
            if p_idx:  # T3: every D rank needs the whole indexer; members split it
                n = len(p_idx)
                if idx_start + n > len(d_idx):
                    raise CutError(f"indexer range [{idx_start}, {idx_start + n}) outside "
                                   f"{len(d_idx)} destination blocks of {ext!r}")
                b, c = self._indexer_part(n, member, ratio, idx_start)
                add(range(MAIN_TENSORS, len(dst)), p_idx[b:b + c],
                    d_idx[idx_start + b:idx_start + b + c])
        return local, remote, lengths


def bind_decode_ranks(make: Any, d_tp: int, *,
                      in_use: tuple[type[BaseException], ...] = (zmq.ZMQError,),
                      attempts: int = 20) -> tuple[int, list[Any]]:
    """Bind ``d_tp`` Decode ranks on consecutive ports ``base + d_rank`` (P1).

    ``make(d_rank, port)`` builds one rank and raises one of ``in_use`` when the port is
    taken; a free base is found by asking the kernel for a free port and trying the span
    above it, closing what a failed attempt had already bound. Any other error is the
    rank's own and propagates at once.
    """
    last: BaseException | None = None
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + d_tp - 1 > 65535:
            continue
        ranks: list[Any] = []
        try:
            for d in range(d_tp):
                ranks.append(make(d, base + d))
            return base, ranks
        except BaseException as exc:
            for r in ranks:
                r.close()
            if not isinstance(exc, in_use):
                raise
            last = exc
    raise RuntimeError(f"no free span of {d_tp} ports after {attempts} attempts: {last}")
