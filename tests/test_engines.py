"""Transfer engines (PROTOCOL X1, F2, F4, L1): real peer processes, real bytes, exact checks.

Every peer runs in its own spawned process and registers memory the usual way (a torch tensor
from the allocator, a numpy array); the test process reads it through the engine and compares
bytes with the pattern the peer was told to write. Failures must come back as non-zero results
within a bounded time and leave the destination exactly as it was.
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from sfa_rd2h.runtime.engines import (
    EngineConfigError,
    EngineError,
    EngineUnavailable,
    RegistrationError,
    TransferResult,
    fake_memfabric,
    make_engine,
    tensor_region,
)
from sfa_rd2h.runtime.engines import host as host_mod
from sfa_rd2h.runtime.engines.base import coalesce, descriptor_arrays
from sfa_rd2h.runtime.engines.host import HostEngine, cma_status
from sfa_rd2h.runtime.engines.memfabric import MemFabricEngine, bound_config, npu_visible
from sfa_rd2h.runtime.tools.probe import add_probe_parser, cmd_probe, pattern, run_local_probe

TENSOR_BYTES = 1 << 20
ARRAY_BYTES = 3 << 20
STORE_URL = "tcp://127.0.0.1:6650"
SENTINEL = 0xAB
PEER_START_S = 60.0


# --------------------------------------------------------------------------- peer process


def _peer_main(conn: Any, kind: str, mode: str) -> None:
    """A serving endpoint in its own process; answers register/unregister/exit commands."""
    keep: list[Any] = []
    regions: dict[str, tuple[int, int, int]] = {}

    def own_array(n: int, seed: int, eng: Any) -> int:
        if kind == "host" and mode == "shm":
            addr, arr = eng.allocate(n)
            arr[:] = pattern(n, seed)
        else:
            arr = pattern(n, seed).copy()
            addr = int(arr.ctypes.data)
            eng.register_memory(addr, n)
        keep.append(arr)
        return addr

    if kind == "host":
        eng: Any = HostEngine(mode=mode)
        session = eng.initialize("127.0.0.1")
        if mode == "cma":
            import torch

            t = torch.from_numpy(pattern(TENSOR_BYTES, 1)).clone()  # storage from torch
            addr, n = tensor_region(t)
            eng.register_memory(addr, n)
            keep.append(t)
            regions["tensor"] = (addr, n, 1)
        else:
            plain = np.zeros(4096, dtype=np.uint8)  # registered, but not in a shm segment
            eng.register_memory(int(plain.ctypes.data), plain.nbytes)
            keep.append(plain)
            regions["plain"] = (int(plain.ctypes.data), plain.nbytes, 0)
    elif kind == "fake_memfabric":
        eng = MemFabricEngine(role="prefill", store_url=STORE_URL,
                              backend_module=fake_memfabric)
        session = eng.initialize("127.0.0.1")
    else:
        from sfa_rd2h.runtime.engines.mooncake import MooncakeEngine

        eng = MooncakeEngine()
        session = eng.initialize("127.0.0.1")
    regions["array"] = (own_array(ARRAY_BYTES, 2, eng), ARRAY_BYTES, 2)
    conn.send({"session": session, "pid": os.getpid(), "regions": regions})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "register":
            _, n, seed = msg
            conn.send(own_array(n, seed, eng))
        elif msg[0] == "unregister":
            eng.unregister_memory(msg[1])
            conn.send("ok")
        else:
            break
    eng.close()


class Peer:
    def __init__(self, kind: str, mode: str = "auto") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, kind, mode), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(PEER_START_S):
            self.proc.kill()
            raise RuntimeError(f"{kind} peer did not start")
        info = self.conn.recv()
        self.session: str = info["session"]
        self.pid: int = info["pid"]
        self.regions: dict[str, tuple[int, int, int]] = info["regions"]

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        assert self.conn.poll(PEER_START_S), f"peer did not answer {msg[0]}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@pytest.fixture(scope="module")
def cma_peer():
    peer = Peer("host", "cma")
    yield peer
    peer.stop()


@pytest.fixture
def reader():
    eng = HostEngine(mode="cma", timeout=2.0)
    yield eng
    eng.close()


def _dest(eng: Any, n: int) -> tuple[np.ndarray, int]:
    buf = np.full(n, SENTINEL, dtype=np.uint8)
    eng.register_memory(int(buf.ctypes.data), n)
    return buf, int(buf.ctypes.data)


def _expect(region: tuple[int, int, int], off: int, n: int) -> np.ndarray:
    return pattern(region[1], region[2])[off:off + n]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- pure helpers


def test_descriptor_validation_and_coalescing() -> None:
    local, peer, n = descriptor_arrays([100, 200, 300], [10, 50, 90], [100, 0, 7])
    assert local.tolist() == [100, 300] and n.tolist() == [100, 7]  # zero-length dropped
    with pytest.raises(ValueError):
        descriptor_arrays([1, 2], [1], [1, 1])
    with pytest.raises(ValueError):
        descriptor_arrays([-1], [1], [1])
    with pytest.raises(ValueError):
        descriptor_arrays(np.array([2**64 - 8], dtype=np.uint64), [0], [16])
    # Pairs contiguous on both sides merge; a gap on either side keeps them apart.
    local = np.array([0, 10, 20, 40], dtype=np.uint64)
    peer = np.array([100, 110, 130, 140], dtype=np.uint64)
    sizes = np.array([10, 10, 20, 5], dtype=np.uint64)
    ml, mp_, mn = coalesce(local, peer, sizes)
    assert ml.tolist() == [0, 20, 40] and mp_.tolist() == [100, 130, 140]
    assert mn.tolist() == [20, 20, 5]


def test_tensor_region_rejects_strided_views() -> None:
    import torch

    t = torch.zeros(4, 8, dtype=torch.float32)
    assert tensor_region(t) == (t.data_ptr(), 128)
    with pytest.raises(RegistrationError) as info:
        tensor_region(t.t())
    assert str(info.value) == "only a contiguous tensor is one registrable byte range"
    with pytest.raises(TypeError) as info2:
        tensor_region(np.zeros(4))  # type: ignore[arg-type]
    assert str(info2.value) == "torch.Tensor expected, got ndarray"


def test_registration_is_idempotent_and_rejects_overlap() -> None:
    eng = HostEngine()
    buf = np.zeros(8192, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    try:
        eng.register_memory(addr, 4096)
        eng.register_memory(addr, 4096)  # the same region again is a no-op
        with pytest.raises(RegistrationError, match="already registered"):
            eng.register_memory(addr, 8192)
        with pytest.raises(RegistrationError, match="overlaps"):
            eng.register_memory(addr + 100, 4096)
        eng.unregister_memory(addr)
        with pytest.raises(RegistrationError, match="no region"):
            eng.unregister_memory(addr)
    finally:
        eng.close()


# --------------------------------------------------------------------------- CMA data path


def test_this_machine_uses_cma_in_auto_mode() -> None:
    permitted, why = cma_status()
    eng = HostEngine()
    try:
        assert eng.mode == ("cma" if permitted else "shm"), why
    finally:
        eng.close()


def test_cma_reads_tensor_and_array_exactly(cma_peer: Peer, reader: HostEngine) -> None:
    dst, base = _dest(reader, 64 << 10)
    t_addr = cma_peer.regions["tensor"][0]
    a_addr = cma_peer.regions["array"][0]
    # (dest offset, peer address, source offset, length, region)
    plan = [
        (0, t_addr + 100, 100, 1000, "tensor"),  # unaligned, from the torch tensor
        (2000, a_addr + 5000, 5000, 4096, "array"),  # gap before it stays untouched
        (10000, t_addr + 8192, 8192, 4096, "tensor"),  # these two coalesce into one copy
        (14096, t_addr + 12288, 12288, 4096, "tensor"),
        (30000, a_addr + ARRAY_BYTES - 777, ARRAY_BYTES - 777, 777, "array"),  # last byte
        (20000, a_addr, 0, 333, "array"),  # out of address order
    ]
    local = np.array([base + p[0] for p in plan], dtype=np.uint64)
    peer = np.array([p[1] for p in plan], dtype=np.uint64)
    sizes = np.array([p[3] for p in plan], dtype=np.uint64)
    assert reader.batch_transfer_sync_read(cma_peer.session, local, peer, sizes) == 0
    want = np.full_like(dst, SENTINEL)
    for d, _, off, n, name in plan:
        want[d:d + n] = _expect(cma_peer.regions[name], off, n)
    np.testing.assert_array_equal(dst, want)

    # Plain Python lists are accepted too.
    dst.fill(SENTINEL)
    ret = reader.batch_transfer_sync_read(
        cma_peer.session, [base + 7], [a_addr + 11], [5000])
    assert ret == 0
    np.testing.assert_array_equal(dst[7:5007], _expect(cma_peer.regions["array"], 11, 5000))
    assert (dst[:7] == SENTINEL).all() and (dst[5007:] == SENTINEL).all()


def _record_syscalls(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The iovec lengths of every process_vm_readv from now on, one list per syscall."""
    syscalls: list[list[int]] = []
    real_readv = host_mod._readv

    def recording_readv(pid: int, local_iov: int, remote_iov: int, count: int) -> Any:
        iov = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(remote_iov))
        syscalls.append(iov[1::2].tolist())
        return real_readv(pid, local_iov, remote_iov, count)

    monkeypatch.setattr(host_mod, "_readv", recording_readv)
    return syscalls


def test_cma_splits_large_batches_into_bounded_syscalls(
    cma_peer: Peer, reader: HostEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shrink the per-piece and per-syscall limits so a 3 MiB read exercises piece splitting,
    # the byte cap and the IOV_MAX cap with real bytes.
    piece, group, iov_max = 64 << 10, 256 << 10, 3
    monkeypatch.setattr(host_mod, "_PIECE_BYTES", piece)
    monkeypatch.setattr(host_mod, "_GROUP_BYTES", group)
    monkeypatch.setattr(host_mod, "IOV_MAX", iov_max)
    syscalls = _record_syscalls(monkeypatch)

    def check_bounds(total: int) -> None:
        assert syscalls, "no syscall was made"
        assert sum(map(sum, syscalls)) == total  # every byte once
        assert max(map(len, syscalls)) <= iov_max  # IOV_MAX iovecs per syscall at most
        assert max(max(lens) for lens in syscalls) <= piece  # no piece over its cap
        # A syscall's pieces start inside one byte window, so it moves < group + piece.
        assert max(map(sum, syscalls)) < group + piece
        syscalls.clear()

    region = cma_peer.regions["array"]
    dst, base = _dest(reader, ARRAY_BYTES)
    block = 3 << 10
    count = ARRAY_BYTES // block
    order = np.random.default_rng(7).permutation(count).astype(np.uint64)
    local = base + order * np.uint64(block)
    peer = region[0] + order * np.uint64(block)
    sizes = np.full(count, block, dtype=np.uint64)
    assert reader.batch_transfer_sync_read(cma_peer.session, local, peer, sizes) == 0
    np.testing.assert_array_equal(dst, pattern(*region[1:]))
    check_bounds(ARRAY_BYTES)
    # One oversized descriptor: 1 MiB, split into 16 pieces of 64 KiB, at most 3 per syscall.
    dst.fill(SENTINEL)
    ret = reader.batch_transfer_sync_read(cma_peer.session, [base], [region[0]], [1 << 20])
    assert ret == 0
    np.testing.assert_array_equal(dst[: 1 << 20], _expect(region, 0, 1 << 20))
    assert (dst[1 << 20:] == SENTINEL).all()
    assert [len(lens) for lens in syscalls] == [3, 1] * 4  # 4 windows of 256 KiB
    check_bounds(1 << 20)
    # Pieces of 48 KiB: the byte window (not the iovec count) closes these syscalls.
    monkeypatch.setattr(host_mod, "IOV_MAX", 1024)
    iov_max = 1024
    dst.fill(SENTINEL)
    n = 48 << 10
    many = np.arange(20, dtype=np.uint64)
    ret = reader.batch_transfer_sync_read(cma_peer.session, base + many * np.uint64(2 * n),
                                          region[0] + many * np.uint64(n),
                                          np.full(20, n, dtype=np.uint64))
    assert ret == 0
    assert [len(lens) for lens in syscalls] == [6, 5, 5, 4]  # windows of 256 KiB by start
    check_bounds(20 * n)
    # One byte over the piece cap is a piece of its own.
    ret = reader.batch_transfer_sync_read(cma_peer.session, [base], [region[0]], [piece + 1])
    assert ret == 0
    assert syscalls == [[piece, 1]]
    check_bounds(piece + 1)
    np.testing.assert_array_equal(dst[: piece + 1], _expect(region, 0, piece + 1))


def test_out_of_bounds_peer_range_fails_and_leaves_destination(
    cma_peer: Peer, reader: HostEngine
) -> None:
    dst, base = _dest(reader, 16 << 10)
    a_addr, a_len, _ = cma_peer.regions["array"]
    ret = reader.batch_transfer_sync_read(
        cma_peer.session,
        [base, base + 8192],
        [a_addr, a_addr + a_len - 100],  # the second runs 1 byte past the registered end
        [4096, 101],
    )
    assert ret == TransferResult.PEER_RANGE
    assert "descriptor 1" in reader.last_error
    assert (dst == SENTINEL).all()


def test_unregistered_local_range_fails_and_leaves_destination(
    cma_peer: Peer, reader: HostEngine
) -> None:
    dst, base = _dest(reader, 8192)
    a_addr = cma_peer.regions["array"][0]
    ret = reader.batch_transfer_sync_read(
        cma_peer.session, [base, base + 8000], [a_addr, a_addr + 8192], [1024, 1024])
    assert ret == TransferResult.LOCAL_RANGE
    assert (dst == SENTINEL).all()


def test_malformed_batches_return_codes_instead_of_raising(
    cma_peer: Peer, reader: HostEngine
) -> None:
    dst, base = _dest(reader, 4096)
    a_addr = cma_peer.regions["array"][0]
    s = cma_peer.session
    assert reader.batch_transfer_sync_read(s, [base], [a_addr], [1, 2]) == (
        TransferResult.BAD_DESCRIPTORS)
    assert reader.batch_transfer_sync_read(s, [base], [a_addr], [-5]) == (
        TransferResult.BAD_DESCRIPTORS)
    assert reader.batch_transfer_sync_read(s, [base], [a_addr], ["x"]) == (
        TransferResult.BAD_DESCRIPTORS)
    for bad in ("nonsense", "127.0.0.1:", "127.0.0.1:99999", None):
        assert reader.batch_transfer_sync_read(bad, [base], [a_addr], [16]) == (
            TransferResult.BAD_SESSION)
    assert (dst == SENTINEL).all()


def test_each_thread_reads_the_reason_of_its_own_failed_read(
    cma_peer: Peer, reader: HostEngine
) -> None:
    """Decode reads on several lanes of one engine at once: a lane that failed reads its
    own reason, not that of another lane failing a moment later."""
    _, base = _dest(reader, 4096)
    a_addr = cma_peer.regions["array"][0]
    both_failed = threading.Barrier(2, timeout=10)
    seen: dict[str, tuple[int, str]] = {}

    def fail(name: str, session: Any, lengths: list[Any]) -> None:
        ret = reader.batch_transfer_sync_read(session, [base], [a_addr], lengths)
        both_failed.wait()  # the other lane has failed too before this one looks
        seen[name] = (ret, reader.last_error)

    lanes = [threading.Thread(target=fail, args=("session", "nonsense", [16])),
             threading.Thread(target=fail, args=("lengths", cma_peer.session, [-5]))]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join(10)
    assert seen["session"][0] == TransferResult.BAD_SESSION
    assert seen["session"][1].startswith("BAD_SESSION"), seen
    assert seen["lengths"][0] == TransferResult.BAD_DESCRIPTORS
    assert seen["lengths"][1].startswith("BAD_DESCRIPTORS"), seen
    assert reader.last_error == ""  # this thread's own calls did not fail


def test_reader_refreshes_after_peer_registers_more_and_sees_unregister(
    cma_peer: Peer, reader: HostEngine
) -> None:
    dst, base = _dest(reader, 64 << 10)
    a_addr = cma_peer.regions["array"][0]
    assert reader.batch_transfer_sync_read(cma_peer.session, [base], [a_addr], [64]) == 0
    new_addr = cma_peer.ask("register", 32 << 10, 9)  # after the reader cached the peer
    ret = reader.batch_transfer_sync_read(cma_peer.session, [base], [new_addr], [32 << 10])
    assert ret == 0, reader.last_error
    np.testing.assert_array_equal(dst[: 32 << 10], pattern(32 << 10, 9))
    later = cma_peer.ask("register", 4096, 3)
    assert reader.batch_transfer_sync_read(cma_peer.session, [base], [later], [4096]) == 0
    assert cma_peer.ask("unregister", new_addr) == "ok"
    dst.fill(SENTINEL)
    ret = reader.batch_transfer_sync_read(cma_peer.session, [base], [new_addr], [4096])
    assert ret == TransferResult.PEER_RANGE
    assert (dst == SENTINEL).all()
    # a second withdrawal is seen too, although the reader's view was refreshed after the
    # first one and still lists this region
    assert cma_peer.ask("unregister", later) == "ok"
    ret = reader.batch_transfer_sync_read(cma_peer.session, [base], [later], [4096])
    assert ret == TransferResult.PEER_RANGE
    assert (dst == SENTINEL).all()


def test_unknown_session_fails_within_bounded_time(reader: HostEngine) -> None:
    dst, base = _dest(reader, 4096)
    t0 = time.monotonic()
    ret = reader.batch_transfer_sync_read(f"127.0.0.1:{_closed_port()}", [base], [base], [16])
    assert ret == TransferResult.PEER_UNREACHABLE
    assert time.monotonic() - t0 < 2.5
    assert (dst == SENTINEL).all()


def test_dead_peer_gives_non_zero_result_and_no_bytes(reader: HostEngine) -> None:
    peer = Peer("host", "cma")
    try:
        dst, base = _dest(reader, 4096)
        a_addr = peer.regions["array"][0]
        assert reader.batch_transfer_sync_read(peer.session, [base], [a_addr], [4096]) == 0
        dst.fill(SENTINEL)
        peer.proc.kill()  # no close(): the engine gets no chance to say goodbye
        peer.proc.join(10)
        t0 = time.monotonic()
        assert reader.batch_transfer_sync_read(peer.session, [base], [a_addr], [4096]) == (
            TransferResult.PEER_GONE)
        assert reader.last_error == f"PEER_GONE: peer process {peer.pid} has exited"
        assert reader.batch_transfer_sync_read(peer.session, [base], [a_addr], [4096]) == (
            TransferResult.PEER_UNREACHABLE)
        assert time.monotonic() - t0 < 2.5
        assert (dst == SENTINEL).all()
    finally:
        peer.stop()
        # A killed owner cannot remove its /dev/shm files; tidy up after it.
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"sfa_rd2h.{peer.pid}."):
                os.unlink(os.path.join("/dev/shm", name))


def test_registry_survives_garbage_and_stops_promptly_despite_a_stalled_client(
    cma_peer: Peer,
) -> None:
    eng = HostEngine(mode="cma", timeout=1.0)
    session = eng.initialize("127.0.0.1")
    port = int(session.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"\xff\xff\xff\xffgarbage")  # absurd frame length: dropped
    other = HostEngine(mode="cma", timeout=1.0)
    try:
        dst, base = _dest(other, 64)
        src = np.arange(64, dtype=np.uint8)
        eng.register_memory(int(src.ctypes.data), 64)
        assert other.batch_transfer_sync_read(session, [base], [int(src.ctypes.data)], [64]) == 0
        np.testing.assert_array_equal(dst, src)
        stalled = socket.create_connection(("127.0.0.1", port))  # connects, never sends
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 2.5
        stalled.close()
        assert other.batch_transfer_sync_read(session, [base], [int(src.ctypes.data)], [64]) == (
            TransferResult.PEER_GONE)
    finally:
        other.close()
        eng.close()


# --------------------------------------------------------------------------- shm data path


def test_forced_shm_mode_moves_bytes_between_processes(cma_peer: Peer) -> None:
    peer = Peer("host", "shm")
    eng = HostEngine(mode="shm", timeout=2.0)
    try:
        assert eng.mode == "shm"
        region = peer.regions["array"]
        dst, base = _dest(eng, 32 << 10)  # plain memory is a valid destination in shm mode
        ret = eng.batch_transfer_sync_read(
            peer.session,
            np.array([base + 4096, base], dtype=np.uint64),
            np.array([region[0], region[0] + ARRAY_BYTES - 4096], dtype=np.uint64),
            np.array([8192, 4096], dtype=np.uint64),
        )
        assert ret == 0, eng.last_error
        np.testing.assert_array_equal(dst[4096:12288], _expect(region, 0, 8192))
        np.testing.assert_array_equal(dst[:4096], _expect(region, ARRAY_BYTES - 4096, 4096))
        assert (dst[12288:] == SENTINEL).all()

        # Registered but not in a shm segment: a shm reader cannot reach it.
        dst.fill(SENTINEL)
        plain = peer.regions["plain"][0]
        assert eng.batch_transfer_sync_read(peer.session, [base], [plain], [64]) == (
            TransferResult.PEER_RANGE)
        # Nor can it read a CMA peer's ordinary tensor.
        t_addr = cma_peer.regions["tensor"][0]
        assert eng.batch_transfer_sync_read(cma_peer.session, [base], [t_addr], [64]) == (
            TransferResult.PEER_RANGE)
        assert (dst == SENTINEL).all()

        # A region the peer allocates later is found after one refresh.
        new_addr = peer.ask("register", 8192, 5)
        assert eng.batch_transfer_sync_read(peer.session, [base], [new_addr], [8192]) == 0
        np.testing.assert_array_equal(dst[:8192], pattern(8192, 5))
    finally:
        eng.close()
        peer.stop()


def test_allocate_files_are_removed_on_close() -> None:
    eng = HostEngine(mode="shm")
    _, arr = eng.allocate(4096)
    names = [n for n in os.listdir("/dev/shm") if n.startswith(f"sfa_rd2h.{os.getpid()}.")]
    assert len(names) >= 2  # control block and the region
    eng.close()
    left = [n for n in os.listdir("/dev/shm") if n in names]
    assert left == []
    arr[0] = 1  # the mapping outlives the file until the array goes


# --------------------------------------------------------------------------- MemFabric


def test_fake_memfabric_moves_bytes_between_two_processes() -> None:
    peer = Peer("fake_memfabric")
    eng = MemFabricEngine(role="decode", store_url=STORE_URL, backend_module=fake_memfabric)
    try:
        session = eng.initialize("127.0.0.1")
        assert session.startswith("127.0.0.1:")
        region = peer.regions["array"]
        dst, base = _dest(eng, 64 << 10)
        ret = eng.batch_transfer_sync_read(
            peer.session, [base + 100, base + 20000], [region[0] + 999, region[0]], [5000, 7])
        assert ret == 0, eng.last_error
        np.testing.assert_array_equal(dst[100:5100], _expect(region, 999, 5000))
        np.testing.assert_array_equal(dst[20000:20007], _expect(region, 0, 7))
        dst.fill(SENTINEL)
        # The fake answers a positive code for a peer-side fault; the engine still fails it.
        ret = eng.batch_transfer_sync_read(peer.session, [base], [region[0] + ARRAY_BYTES], [8])
        assert ret == TransferResult.BACKEND
        assert "returned 4" in eng.last_error
        assert eng.batch_transfer_sync_read(peer.session, [base - 64], [region[0]], [8]) == (
            TransferResult.LOCAL_RANGE)
        assert (dst == SENTINEL).all()
    finally:
        eng.close()
        peer.stop()


def test_memfabric_engine_is_one_process_wide_binding_f4() -> None:
    kw = {"store_url": STORE_URL, "backend_module": fake_memfabric}
    first = MemFabricEngine(role="decode", device_id=0, **kw)
    second = MemFabricEngine(role="Decode", device_id=0, **kw)
    try:
        session = first.initialize("127.0.0.1")
        assert second.initialize("127.0.0.1") == session  # same configuration: shared
        with pytest.raises(EngineConfigError) as err:
            MemFabricEngine(role="prefill", device_id=0, **kw).initialize("127.0.0.1")
        assert "role=Decode" in str(err.value) and "role=Prefill" in str(err.value)
        with pytest.raises(EngineConfigError, match="device=1"):
            MemFabricEngine(role="decode", device_id=1, **kw).initialize("127.0.0.1")
        with pytest.raises(EngineConfigError, match="hostname=localhost"):
            MemFabricEngine(role="decode", device_id=0, **kw).initialize("localhost")
        buf = np.zeros(8192, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        first.register_memory(addr, 8192)
        second.register_memory(addr, 8192)  # registered once, whoever asks
        with pytest.raises(RegistrationError):
            second.register_memory(addr, 4096)
        first.close()
        assert bound_config() is not None  # the second handle still holds it
    finally:
        first.close()
        second.close()
    assert bound_config() is None
    other = MemFabricEngine(role="prefill", **kw)  # released: a new binding is allowed
    try:
        assert other.initialize("127.0.0.1")
    finally:
        other.close()


def test_memfabric_rejects_bad_configuration() -> None:
    with pytest.raises(EngineConfigError, match="role"):
        MemFabricEngine(role="both", backend_module=fake_memfabric)
    with pytest.raises(EngineConfigError, match="data_op_type"):
        MemFabricEngine(role="decode", data_op_type="PIGEON", backend_module=fake_memfabric)
    eng = MemFabricEngine(role="decode", backend_module=fake_memfabric)
    env = os.environ.pop("ASCEND_MF_STORE_URL", None)
    try:
        with pytest.raises(EngineConfigError, match="store"):
            eng.initialize("127.0.0.1")
    finally:
        if env is not None:
            os.environ["ASCEND_MF_STORE_URL"] = env
    assert bound_config() is None


def test_memfabric_unavailable_on_this_cpu_machine() -> None:
    try:
        import memfabric_hybrid  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    if importable and npu_visible():  # an Ascend host: the real engine must construct
        make_engine("memfabric", role="decode").close()
        return
    with pytest.raises(EngineUnavailable, match="^memfabric engine unavailable: "):
        make_engine("memfabric", role="decode")  # the engine's own reason, not "unknown"
    with pytest.raises(EngineUnavailable) as info:
        make_engine("carrier-pigeon")
    assert str(info.value) == ("unknown transfer engine 'carrier-pigeon'; known engines: "
                               "host, memfabric, mooncake")


# --------------------------------------------------------------------------- Mooncake


def test_mooncake_engine_moves_bytes_between_two_processes() -> None:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda absent")
    peer = Peer("mooncake")
    eng = make_engine("mooncake")
    try:
        eng.initialize("127.0.0.1")
        region = peer.regions["array"]
        dst, base = _dest(eng, 64 << 10)
        ret = eng.batch_transfer_sync_read(
            peer.session, [base + 10, base + 30000], [region[0] + 3, region[0] + 70000],
            [20000, 1234])
        assert ret == 0, eng.last_error
        np.testing.assert_array_equal(dst[10:20010], _expect(region, 3, 20000))
        np.testing.assert_array_equal(dst[30000:31234], _expect(region, 70000, 1234))
        dst.fill(SENTINEL)
        assert eng.batch_transfer_sync_read(peer.session, [base - 8], [region[0]], [16]) == (
            TransferResult.LOCAL_RANGE)
        assert eng.batch_transfer_sync_read(
            peer.session, [base], [region[0] + ARRAY_BYTES - 8], [16]) != 0
        assert (dst == SENTINEL).all()
    finally:
        eng.close()
        peer.stop()


# --------------------------------------------------------------------------- probe


def test_local_probe_verifies_every_byte() -> None:
    result = run_local_probe("host", 8 << 20, repeats=2, block_bytes=1 << 20, timeout=30)
    assert result["ok"], result
    assert result["verified"] and result["bytes"] == 8 << 20
    assert result["descriptors"] == 8 and len(result["seconds"]) == 2
    assert result["prefill_rc"] == 0 and result["prefill_pid"] != os.getpid()
    assert result["mode"] == ("cma" if cma_status()[0] else "shm")


def test_probe_cli_two_endpoints_through_a_rendezvous_file(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    rendezvous = str(tmp_path / "probe.json")
    cli = argparse.ArgumentParser(prog="sfa-rd2h")
    add_probe_parser(cli.add_subparsers(dest="command"))
    common = ["--engine", "host", "--host-mode", "shm", "--rendezvous", rendezvous,
              "--timeout", "30"]
    prefill = subprocess.Popen(
        [sys.executable, "-m", "sfa_rd2h.runtime.tools.probe", "--role", "prefill", "--bytes", "3M",
         "--json", *common],
        stdout=subprocess.PIPE, text=True)
    try:
        args = cli.parse_args(["probe", "--role", "decode", "--block-bytes", "256K", "--json",
                               *common])
        assert args.func is cmd_probe
        assert args.func(args) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["ok"] and report["verified"] and report["mode"] == "shm"
        assert report["bytes"] == 3 << 20 and report["descriptors"] == 12
        out, _ = prefill.communicate(timeout=30)
        assert prefill.returncode == 0
        announced, final = (json.loads(line) for line in out.strip().splitlines())
        assert announced["session"] == report["peer"]
        assert final["ok"] and final["reader"]["verified"]
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


# --------------------------------------------------------------------------- hostile registry


def _forger_main(conn: Any, genuine_session: str, claim_pid: int) -> None:
    """A registry that answers for another process: it copies a genuine answer and claims
    ``claim_pid`` with every address below 2**47 registered (issue: arbitrary memory read)."""
    host, port = genuine_session.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        host_mod._send_frame(s, {"op": "describe", "v": host_mod._WIRE_VERSION})
        reply = host_mod._recv_frame(s)
    reply.update(pid=claim_pid, start=host_mod._proc_start_time(claim_pid),
                 addrs=[4096], lens=[(1 << 47) - 4096])
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        listener.settimeout(30)
        while not conn.poll(0):
            try:
                client, _ = listener.accept()
            except TimeoutError:
                break
            with client:
                host_mod._recv_frame(client)
                host_mod._send_frame(client, reply)


@pytest.mark.parametrize("victim", ["prefill", "decode itself"])
def test_a_forged_registry_cannot_make_decode_read_unregistered_memory(
        cma_peer: Peer, reader: HostEngine, victim: str) -> None:
    """A registry must prove it speaks for the pid it names (kernel-verified socket owner);
    otherwise nothing is read and the destination stays as it was."""
    secret = np.frombuffer(b"unregistered secret " * 50, dtype=np.uint8).copy()
    claim = cma_peer.pid if victim == "prefill" else os.getpid()
    target = cma_peer.regions["tensor"][0] - 8192 if victim == "prefill" \
        else int(secret.ctypes.data)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    forger = ctx.Process(target=_forger_main, args=(child, cma_peer.session, claim), daemon=True)
    forger.start()
    try:
        assert conn.poll(PEER_START_S)
        session = f"127.0.0.1:{conn.recv()}"
        dst, base = _dest(reader, 1000)
        t0 = time.monotonic()
        ret = reader.batch_transfer_sync_read(session, [base], [target], [1000])
        assert ret == TransferResult.PEER_UNREACHABLE
        assert time.monotonic() - t0 < 5.0
        assert (dst == SENTINEL).all()
    finally:
        conn.send("stop")
        forger.join(10)
        if forger.is_alive():
            forger.kill()


def test_registry_answers_only_readers_on_this_host() -> None:
    class Remote:
        def getpeername(self) -> tuple[str, int]:
            return ("10.1.2.3", 5555)

        def getsockname(self) -> tuple[str, int]:
            return ("10.9.9.9", 4000)

    assert not host_mod._is_local_client(Remote())  # type: ignore[arg-type]
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.create_connection(srv.getsockname()) as c:
        conn, _ = srv.accept()
        with conn:
            assert host_mod._is_local_client(conn)
            # The kernel names this test process as the holder of the accepted socket.
            inode = host_mod._server_socket_inode(c)
            assert inode is not None and host_mod._holds_socket(os.getpid(), inode)
            assert not host_mod._holds_socket(os.getppid(), inode)


def test_ptracer_is_narrow_unless_asked() -> None:
    """Yama scope 1: the owner names one ancestor of its readers, not every process."""
    assert host_mod.ptracer_pid("parent") == os.getppid()
    assert host_mod.ptracer_pid(" 1234 ") == 1234
    assert host_mod.ptracer_pid("1") == 1  # init: an ancestor of every process
    assert host_mod.ptracer_pid("any") == host_mod._PR_SET_PTRACER_ANY
    assert host_mod.ptracer_pid(" ANY ") == host_mod._PR_SET_PTRACER_ANY
    for bad in ("everyone", "0", "-5"):
        with pytest.raises(EngineConfigError) as info:
            host_mod.ptracer_pid(bad)
        assert str(info.value) == (
            f"SFA_RD2H_PTRACER must be 'parent', 'any' or a pid, not {bad!r}")


def test_ptracer_comes_from_the_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SFA_RD2H_PTRACER", raising=False)
    assert host_mod.ptracer_pid() == os.getppid()
    monkeypatch.setenv("SFA_RD2H_PTRACER", "4321")
    assert host_mod.ptracer_pid() == 4321
    assert host_mod.ptracer_pid("parent") == os.getppid()  # an explicit setting wins


# --------------------------------------------------------------------------- test strength
# (issue 12) Each test below states a behaviour a user relies on; each was checked to fail
# against a single planted bug in the code it names.


def test_a_batch_of_more_than_iov_max_separate_descriptors_reads_correctly(
    cma_peer: Peer, reader: HostEngine
) -> None:
    """The kernel refuses one process_vm_readv with more than 1024 iovecs (EINVAL), so a
    layer read with more separate descriptors than that must be split into syscalls of at
    most IOV_MAX, with the real limit (no monkeypatching)."""
    region = cma_peer.regions["array"]
    count, size = 3 * host_mod.IOV_MAX + 7, 64
    dst, base = _dest(reader, count * 2 * size)
    # A gap after every destination block: nothing coalesces, every descriptor stays one iovec.
    local = base + np.arange(count, dtype=np.uint64) * np.uint64(2 * size)
    order = np.random.default_rng(3).permutation(count).astype(np.uint64)
    peer = region[0] + order * np.uint64(size)
    sizes = np.full(count, size, dtype=np.uint64)
    assert coalesce(local, peer, sizes)[0].size == count
    assert reader.batch_transfer_sync_read(cma_peer.session, local, peer, sizes) == 0, (
        reader.last_error)
    source = pattern(*region[1:])
    got = dst.reshape(count, 2 * size)
    want = source[: count * size].reshape(count, size)[order.astype(np.intp)]
    np.testing.assert_array_equal(got[:, :size], want)
    assert (got[:, size:] == SENTINEL).all()  # the gaps stay untouched


@pytest.mark.parametrize("extra", [0, 1])
def test_a_batch_at_the_iov_max_boundary_reads_correctly(
    cma_peer: Peer, reader: HostEngine, monkeypatch: pytest.MonkeyPatch, extra: int
) -> None:
    """Exactly IOV_MAX separate descriptors fit one process_vm_readv; one more must start a
    second syscall, since the kernel refuses 1025 iovecs (EINVAL) and the read would fail.
    The real limit, no monkeypatching of it."""
    region = cma_peer.regions["array"]
    count, size = host_mod.IOV_MAX + extra, 64
    dst, base = _dest(reader, count * 2 * size)
    local = base + np.arange(count, dtype=np.uint64) * np.uint64(2 * size)  # gaps: no merging
    order = np.random.default_rng(5).permutation(count).astype(np.uint64)
    peer = region[0] + order * np.uint64(size)
    sizes = np.full(count, size, dtype=np.uint64)
    syscalls = _record_syscalls(monkeypatch)
    assert reader.batch_transfer_sync_read(cma_peer.session, local, peer, sizes) == 0, (
        reader.last_error)
    got = dst.reshape(count, 2 * size)
    want = pattern(*region[1:])[: count * size].reshape(count, size)[order.astype(np.intp)]
    np.testing.assert_array_equal(got[:, :size], want)
    assert (got[:, size:] == SENTINEL).all()
    assert [len(lens) for lens in syscalls] == [host_mod.IOV_MAX] + [1] * extra


def _serving_pair() -> tuple[HostEngine, HostEngine, np.ndarray, int]:
    """An owner and a reader engine in this process (CMA on our own pid is always
    permitted): the owner serves one registered array."""
    owner = HostEngine(mode="cma", timeout=2.0)
    other = HostEngine(mode="cma", timeout=2.0)
    owner.initialize("127.0.0.1")
    src = pattern(8192, 4).copy()
    owner.register_memory(int(src.ctypes.data), src.nbytes)
    return owner, other, src, int(src.ctypes.data)


def test_a_peer_that_unregisters_during_the_copy_fails_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes copied while the owner withdrew the region are suspect: the read must not
    report success (the check after the copy, not only the one before it)."""
    owner, other, src, addr = _serving_pair()
    try:
        dst, base = _dest(other, src.nbytes)
        assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [4096]) == 0
        real_copy = host_mod._copy

        def copy_then_unregister(*args: Any) -> tuple[int, str]:
            got = real_copy(*args)
            owner.unregister_memory(addr)  # the owner withdraws it while we copy
            return got

        monkeypatch.setattr(host_mod, "_copy", copy_then_unregister)
        ret = other.batch_transfer_sync_read(owner.session_id, [base], [addr], [4096])
        assert ret == TransferResult.PEER_RANGE, other.last_error
        assert other.last_error == (
            "PEER_RANGE: during the copy: peer unregistered memory since it was described")
    finally:
        other.close()
        owner.close()


def test_a_peer_that_closes_during_the_copy_fails_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owner, other, src, addr = _serving_pair()
    try:
        dst, base = _dest(other, src.nbytes)
        assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64]) == 0
        real_copy = host_mod._copy

        def copy_then_close(*args: Any) -> tuple[int, str]:
            got = real_copy(*args)
            owner.close()
            return got

        monkeypatch.setattr(host_mod, "_copy", copy_then_close)
        ret = other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64])
        assert ret == TransferResult.PEER_GONE, other.last_error
    finally:
        other.close()
        owner.close()


def test_close_releases_the_registry_port() -> None:
    """After close() nothing listens on the registry port any more: connections are
    refused, the port can be bound again, and no socket is left for the collector."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        eng = HostEngine(mode="cma", timeout=1.0)
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=2.0):
            pass  # it listens while open
        eng.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2.0).close()
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))
        del eng
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)
              and "socket" in str(w.message)]
    assert leaked == []


def test_a_peer_range_that_wraps_past_2_64_is_refused_untouched(
    cma_peer: Peer, reader: HostEngine
) -> None:
    """A source address + length beyond the address space is a malformed descriptor, on the
    peer side as on the local side (uint64 arithmetic would wrap it to a small end)."""
    dst, base = _dest(reader, 64)
    wrap = (1 << 64) - 8
    with pytest.raises(ValueError, match="past the end of the address space"):
        descriptor_arrays([base], [wrap], [16])
    ret = reader.batch_transfer_sync_read(cma_peer.session, [base], [wrap], [16])
    assert ret == TransferResult.BAD_DESCRIPTORS
    assert "past the end of the address space" in reader.last_error
    assert (dst == SENTINEL).all()


def test_a_region_overlapping_either_neighbour_is_refused() -> None:
    """Registration keeps regions disjoint whichever neighbour a new region runs into: the
    one before it, the one after it, or several."""
    eng = HostEngine()
    buf = np.zeros(1 << 16, dtype=np.uint8)
    a = int(buf.ctypes.data)
    try:
        for off in (4096, 16384, 32768):  # three regions with gaps between them
            eng.register_memory(a + off, 4096)
        cases = [
            (a + 4096 + 2048, 4096),  # starts inside the first, ends in the gap
            (a + 16384 - 100, 200),  # starts in a gap, ends inside the second
            (a + 8192, 16384 + 100),  # starts in a gap, runs into the second
            (a + 100, 40000),  # covers all three
            (a + 32768 + 4095, 1),  # the last byte of the third
        ]
        for addr, n in cases:
            with pytest.raises(RegistrationError, match="overlaps"):
                eng.register_memory(addr, n)
        eng.register_memory(a + 8192, 8192)  # the gap itself, exactly, is fine
        eng.register_memory(a + 20480, 32768 - 20480)  # and the gap up to the third
    finally:
        eng.close()


# --------------------------------------------------------------------------- library wrappers
# The Mooncake wrapper's own promises, against a stand-in library that answers as told: what
# it hands the library, and how every refusal of the library reaches the caller (F2, X1).


class _FakeMooncake:
    """Stands in for ``mooncake.engine`` or ``memfabric_hybrid``: records every call on its
    engines, answers as the test sets."""

    __name__ = "fake_library"

    class TransDataOpType(enum.Enum):
        SDMA = 1
        DEVICE_RDMA = 3

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.answers: dict[str, Any] = {}  # method -> return value, or an exception to raise
        self.last_error: Any = "no peer at that session"  # or an exception to raise
        fake = self

        class TransferEngine:
            def __getattr__(self, method: str) -> Any:
                def call(*args: Any) -> Any:
                    fake.calls.append((method, *args))
                    got = fake.answers.get(method, 17001 if method == "get_rpc_port" else 0)
                    if isinstance(got, Exception):
                        raise got
                    return got
                return call

        self.TransferEngine = TransferEngine

    def get_last_err_msg(self) -> str:
        if isinstance(self.last_error, Exception):
            raise self.last_error
        return str(self.last_error)


def _mooncake(fake: _FakeMooncake, **kw: Any) -> Any:
    from sfa_rd2h.runtime.engines.mooncake import MooncakeEngine

    return MooncakeEngine(backend_module=fake, **kw)  # type: ignore[arg-type]


def test_mooncake_wrapper_initializes_once_with_its_settings() -> None:
    fake = _FakeMooncake()
    eng = _mooncake(fake, protocol="rdma", metadata_server="etcd://m:1", device_name="mlx5_0")
    assert eng.session_id == ""
    assert eng.initialize("10.0.0.5", 7000) == "10.0.0.5:17001" == eng.session_id
    assert eng.initialize("10.0.0.5", 7000) == "10.0.0.5:17001"  # once is enough
    assert fake.calls == [("initialize", "10.0.0.5:7000", "etcd://m:1", "rdma", "mlx5_0"),
                          ("get_rpc_port",)]
    other = _FakeMooncake()
    assert _mooncake(other).initialize() == "127.0.0.1:17001"
    assert other.calls[0] == ("initialize", "127.0.0.1", "P2PHANDSHAKE", "tcp", "")


def test_mooncake_wrapper_reports_a_library_that_cannot_start() -> None:
    fake = _FakeMooncake()
    fake.answers["initialize"] = -1
    eng = _mooncake(fake)
    with pytest.raises(EngineUnavailable) as info:
        eng.initialize("127.0.0.1")
    assert str(info.value) == ("Mooncake initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp') "
                               "returned -1")
    fake.answers["initialize"] = RuntimeError("no NIC")
    with pytest.raises(EngineUnavailable, match="^Mooncake initialize raised: no NIC$"):
        eng.initialize("127.0.0.1")
    assert eng.session_id == ""
    with pytest.raises(EngineError, match="not initialised"):
        eng.register_memory(0x1000, 64)
    with pytest.raises(EngineError, match="not initialised"):
        eng.unregister_memory(0x1000)
    assert eng.batch_transfer_sync_read("h:1", [0x1000], [0x2000], [8]) == TransferResult.CLOSED
    assert eng.last_error == "CLOSED: Mooncake engine is not initialised"


def _assert_withdrawn_through_the_library(eng: Any, fake: Any, at: int, nbytes: int) -> None:
    """A withdrawal the library takes: asked for exactly that address, and the region is
    gone (a second withdrawal is refused)."""
    eng.register_memory(at, nbytes)
    fake.answers["unregister_memory"] = 0
    fake.calls.clear()
    eng.unregister_memory(at)
    assert fake.calls == [("unregister_memory", at)]
    with pytest.raises(RegistrationError, match="no region is registered"):
        eng.unregister_memory(at)


def test_mooncake_wrapper_reads_and_registers_through_the_library() -> None:
    fake = _FakeMooncake()
    eng = _mooncake(fake)
    eng.initialize()
    dst = np.zeros(4096, dtype=np.uint8)
    base = int(dst.ctypes.data)
    eng.register_memory(base, 4096)
    eng.register_memory(base, 4096)  # idempotent: the library is asked once
    fake.calls.clear()
    # Two descriptors contiguous on both sides reach the library as one, as Python ints.
    assert eng.batch_transfer_sync_read("p:1", [base, base + 64], [0x9000, 0x9040],
                                        [64, 32]) == 0
    assert fake.calls == [("batch_transfer_sync_read", "p:1", [base], [0x9000], [96])]
    assert all(type(v) is int for v in fake.calls[0][2] + fake.calls[0][3] + fake.calls[0][4])
    fake.calls.clear()
    assert eng.batch_transfer_sync_read("p:1", [], [], []) == 0  # nothing to move
    assert eng.batch_transfer_sync_read("p:1", [base + 4090], [0x9000], [8]) == (
        TransferResult.LOCAL_RANGE)
    assert fake.calls == []  # refused before the library runs
    fake.answers["batch_transfer_sync_read"] = -3
    assert eng.batch_transfer_sync_read("p:1", [base], [0x9000], [8]) == TransferResult.BACKEND
    assert eng.last_error == "BACKEND: Mooncake batch_transfer_sync_read returned -3"
    fake.answers["batch_transfer_sync_read"] = OSError("peer reset")
    assert eng.batch_transfer_sync_read("p:1", [base], [0x9000], [8]) == TransferResult.BACKEND
    assert eng.last_error == "BACKEND: Mooncake read raised: peer reset"
    # A registration the library refuses is not kept: asked again, the library is asked again.
    other = np.zeros(64, dtype=np.uint8)
    at = int(other.ctypes.data)
    fake.answers["register_memory"] = -5
    with pytest.raises(RegistrationError) as info:
        eng.register_memory(at, 64)
    assert str(info.value) == f"Mooncake register_memory(0x{at:x}, 64) returned -5"
    fake.answers["register_memory"] = 0
    fake.calls.clear()
    eng.register_memory(at, 64)
    assert fake.calls == [("register_memory", at, 64)]
    fake.answers["unregister_memory"] = -2
    with pytest.raises(RegistrationError) as info:
        eng.unregister_memory(at)
    assert str(info.value) == f"Mooncake unregister_memory(0x{at:x}) returned -2"
    with pytest.raises(RegistrationError, match="no region is registered"):
        eng.unregister_memory(0x10)
    _assert_withdrawn_through_the_library(eng, fake, at, 64)


def test_mooncake_wrapper_close_releases_every_region() -> None:
    fake = _FakeMooncake()
    eng = _mooncake(fake)
    eng.initialize()
    bufs = [np.zeros(64, dtype=np.uint8) for _ in range(3)]
    addrs = sorted(int(b.ctypes.data) for b in bufs)
    for a in addrs:
        eng.register_memory(a, 64)
    fake.answers["unregister_memory"] = RuntimeError("already gone")  # teardown goes on
    fake.calls.clear()
    eng.close()
    assert fake.calls == [("unregister_memory", a) for a in addrs]
    assert eng.session_id == ""
    eng.close()  # idempotent
    assert len(fake.calls) == 3
    assert eng.batch_transfer_sync_read("p:1", [addrs[0]], [1], [8]) == TransferResult.CLOSED


def _memfabric(fake: _FakeMooncake, **kw: Any) -> MemFabricEngine:
    return MemFabricEngine(backend_module=fake, **kw)  # type: ignore[arg-type]


def test_memfabric_wrapper_refuses_a_configuration_the_library_cannot_take() -> None:
    fake = _FakeMooncake()
    for kw, text in (
        ({"role": "both"}, "MemFabric role must be 'Prefill' or 'Decode', not 'both'"),
        ({"role": "decode", "store_server_role": "store"},
         "MemFabric role must be 'Prefill' or 'Decode', not 'store'"),
        ({"role": "decode", "device_id": -1}, "MemFabric device id must be >= 0, not -1"),
        ({"role": "decode", "data_op_type": "PIGEON"},
         "MemFabric data_op_type 'PIGEON' is not one of ['DEVICE_RDMA', 'SDMA']"),
    ):
        with pytest.raises(EngineConfigError) as info:
            _memfabric(fake, **kw)
        assert str(info.value) == text
    assert fake.calls == []


def test_memfabric_wrapper_hands_the_library_its_settings_and_shares_one_binding() -> None:
    """F4: the first handle initialises the library with every setting; a second handle of
    the same configuration shares it; the last close tears it down, every step of it."""
    fake = _FakeMooncake()
    first = _memfabric(fake, role="DECODE", device_id=3, store_url="tcp://10.0.0.1:6650",
                       data_op_type="DEVICE_RDMA", store_server_role="prefill", nic="eth1")
    second = _memfabric(fake, role="Decode", device_id=3)
    try:
        assert first.session_id == ""
        assert first.initialize("127.0.0.1", 7000) == "127.0.0.1:7000" == first.session_id
        assert fake.calls == [("initialize", "tcp://10.0.0.1:6650", "127.0.0.1:7000", "Decode",
                               3, _FakeMooncake.TransDataOpType.DEVICE_RDMA, "Prefill",
                               "eth1")]
        assert bound_config() == "role=Decode device=3 hostname=127.0.0.1 backend=fake_library"
        assert second.initialize("127.0.0.1") == "127.0.0.1:7000"  # shared, not re-made
        assert second.initialize("127.0.0.1", 7000) == "127.0.0.1:7000"
        with pytest.raises(EngineConfigError) as info:
            second.initialize("127.0.0.1", 7001)
        assert str(info.value) == ("F4: the process-wide MemFabric engine serves "
                                   "127.0.0.1:7000; it cannot also serve port 7001")
        third = _memfabric(fake, role="Decode", device_id=4)
        with pytest.raises(EngineConfigError) as info:
            third.initialize("127.0.0.1")
        assert str(info.value) == (
            "F4: the process-wide MemFabric engine is bound to [role=Decode device=3 "
            "hostname=127.0.0.1 backend=fake_library]; it cannot be re-configured as "
            "[role=Decode device=4 hostname=127.0.0.1 backend=fake_library]")
        assert len(fake.calls) == 1
        fake.answers["destroy"] = RuntimeError("device busy")  # the next step still runs
        first.close()
        assert bound_config() is not None and len(fake.calls) == 1  # second still uses it
        first.close()  # a closed handle does not release the other's share
        assert bound_config() is not None
    finally:
        second.close()
    assert bound_config() is None
    assert [c[0] for c in fake.calls[1:]] == ["destroy", "unInitialize"]


def test_memfabric_wrapper_reports_what_the_library_refused_and_why() -> None:
    fake = _FakeMooncake()
    eng = _memfabric(fake, role="Decode", store_url="tcp://10.0.0.1:6650")
    fake.answers["initialize"] = -7
    with pytest.raises(EngineUnavailable) as info:
        eng.initialize("127.0.0.1", 7000)
    config = "role=Decode device=0 hostname=127.0.0.1 backend=fake_library"
    assert str(info.value) == (f"MemFabric initialize returned -7 for [{config}] "
                               "session=127.0.0.1:7000 store=tcp://10.0.0.1:6650: "
                               "no peer at that session")
    fake.answers["initialize"] = RuntimeError("driver missing")
    with pytest.raises(EngineUnavailable) as info:
        eng.initialize("127.0.0.1", 7000)
    assert str(info.value) == (f"MemFabric initialize raised for [{config}] "
                               "store=tcp://10.0.0.1:6650: driver missing")
    assert bound_config() is None and eng.session_id == ""
    with pytest.raises(EngineError, match="not initialised"):
        eng.register_memory(0x1000, 64)
    assert eng.batch_transfer_sync_read("h:1", [1], [1], [1]) == TransferResult.CLOSED
    assert eng.last_error == "CLOSED: MemFabric engine is not initialised"
    fake.answers["initialize"] = 0
    eng.initialize("127.0.0.1", 7000)
    try:
        buf = np.zeros(128, dtype=np.uint8)
        at = int(buf.ctypes.data)
        fake.answers["register_memory"] = -1
        with pytest.raises(RegistrationError) as info:
            eng.register_memory(at, 128)
        assert str(info.value) == (f"MemFabric register_memory(0x{at:x}, 128) returned -1: "
                                   "no peer at that session")
        fake.answers["register_memory"] = 0
        eng.register_memory(at, 128)  # refused before, so asked again
        fake.answers["batch_transfer_sync_read"] = 5  # positive codes are failures too
        fake.last_error = RuntimeError("the diagnostics call itself fails")
        assert eng.batch_transfer_sync_read("h:1", [at], [0x5000], [64]) == (
            TransferResult.BACKEND)
        assert eng.last_error == "BACKEND: MemFabric batch_transfer_sync_read returned 5: no detail"
        fake.last_error = "link down"
        fake.answers["unregister_memory"] = -3
        with pytest.raises(RegistrationError) as info:
            eng.unregister_memory(at)
        assert str(info.value) == f"MemFabric unregister_memory(0x{at:x}) returned -3: link down"
        eng.register_memory(at, 128)
        fake.answers["unregister_memory"] = OSError("gone")
        with pytest.raises(RegistrationError) as info:
            eng.unregister_memory(at)
        assert str(info.value) == "MemFabric unregister_memory raised: gone"
        # a refusal with no diagnostics says so; a withdrawal the library takes is asked
        # for exactly that address and leaves nothing registered
        eng.register_memory(at, 128)
        fake.last_error = ""
        fake.answers["unregister_memory"] = -4
        with pytest.raises(RegistrationError) as info:
            eng.unregister_memory(at)
        assert str(info.value) == f"MemFabric unregister_memory(0x{at:x}) returned -4: no detail"
        _assert_withdrawn_through_the_library(eng, fake, at, 128)
    finally:
        eng.close()


def test_memfabric_needs_an_npu_even_when_its_library_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sfa_rd2h.runtime.engines import memfabric as mf

    library = type(sys)("memfabric_hybrid")
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", library)
    monkeypatch.setattr(mf.glob, "glob", lambda pattern: [])
    with pytest.raises(EngineUnavailable) as info:
        mf.load_memfabric()
    assert str(info.value) == (
        "memfabric engine unavailable: memfabric_hybrid is installed but no Ascend NPU is "
        "visible (no /dev/davinci* device); use the 'host' engine on this machine")
    seen: list[str] = []
    monkeypatch.setattr(mf.glob, "glob", lambda pattern: seen.append(pattern) or [pattern])
    assert mf.load_memfabric() is library
    assert seen == ["/dev/davinci[0-9]*"]
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", None)  # the import itself fails
    with pytest.raises(EngineUnavailable) as info:
        mf.load_memfabric()
    assert str(info.value).startswith(
        "memfabric engine unavailable: memfabric_hybrid cannot be imported (install "
        "memfabric-hybrid==1.3.0 via the 'npu' extra on an Ascend host): ")


def test_mooncake_wrapper_names_what_is_missing_when_its_library_does_not_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sfa_rd2h.runtime.engines.mooncake import load_mooncake

    monkeypatch.setitem(sys.modules, "mooncake", None)  # the import itself fails
    with pytest.raises(EngineUnavailable) as info:
        load_mooncake()
    assert str(info.value) == (
        "mooncake engine unavailable: install Debian libibverbs1 and 'pip install "
        f"mooncake-transfer-engine-non-cuda': {info.value.__cause__}")
    assert isinstance(info.value.__cause__, ImportError)


def test_a_wrapper_used_before_initialize_says_so_in_full() -> None:
    with pytest.raises(EngineError) as info:
        _mooncake(_FakeMooncake()).register_memory(0x1000, 64)
    assert str(info.value) == "Mooncake engine is not initialised (or already closed)"
    with pytest.raises(EngineError) as info:
        _memfabric(_FakeMooncake(), role="decode").unregister_memory(0x1000)
    assert str(info.value) == "MemFabric engine is not initialised (or already closed)"


class _FakeWithoutDiagnostics(_FakeMooncake):
    """A library that offers no get_last_err_msg at all."""

    def __getattribute__(self, name: str) -> Any:
        if name == "get_last_err_msg":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_memfabric_wrapper_defaults_and_a_library_without_diagnostics() -> None:
    """Unset, the store server is Decode and no NIC is named; the session port is one the
    kernel called free, on IPv6 as on IPv4; a library that offers no get_last_err_msg
    still gets its refusals reported, as 'no detail'."""
    fake = _FakeMooncake()
    eng = _memfabric(fake, role="prefill", store_url="tcp://10.0.0.1:6650")
    try:
        session = eng.initialize("::1")
        host, port = session.rsplit(":", 1)
        assert host == "::1" and int(port) > 0
        assert fake.calls == [("initialize", "tcp://10.0.0.1:6650", session, "Prefill", 0,
                               _FakeMooncake.TransDataOpType.SDMA, "Decode", "")]
    finally:
        eng.close()
    mute = _FakeWithoutDiagnostics()
    eng = _memfabric(mute, role="prefill", store_url="tcp://10.0.0.1:6650")
    try:
        session = eng.initialize("127.0.0.1")
        with socket.socket() as s:  # the port was free when asked for
            s.bind(("127.0.0.1", int(session.rsplit(":", 1)[1])))
        buf = np.zeros(64, dtype=np.uint8)
        at = int(buf.ctypes.data)
        mute.answers["register_memory"] = -1
        with pytest.raises(RegistrationError) as info:
            eng.register_memory(at, 64)
        assert str(info.value) == f"MemFabric register_memory(0x{at:x}, 64) returned -1: no detail"
    finally:
        eng.close()


def test_memfabric_wrapper_store_url_from_the_env_loopback_default_and_bare_refusals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without store_url= the config store comes from ASCEND_MF_STORE_URL; initialize()
    without a host binds a loopback session; a refusal the library explains nothing about
    says 'no detail', one it explains carries the library's words; a library whose
    TransDataOpType is no enum is refused by name."""
    fake = _FakeMooncake()
    monkeypatch.setenv("ASCEND_MF_STORE_URL", "tcp://10.0.0.9:6650")
    eng = _memfabric(fake, role="decode")
    fake.last_error = ""
    fake.answers["initialize"] = -7
    with pytest.raises(EngineUnavailable) as info:
        eng.initialize(port=7000)
    config = "role=Decode device=0 hostname=127.0.0.1 backend=fake_library"
    assert str(info.value) == (f"MemFabric initialize returned -7 for [{config}] "
                               "session=127.0.0.1:7000 store=tcp://10.0.0.9:6650: no detail")
    fake.answers["initialize"] = 0
    try:
        assert eng.initialize().startswith("127.0.0.1:")
        assert fake.calls[-1][1] == "tcp://10.0.0.9:6650"
        buf = np.zeros(64, dtype=np.uint8)
        at = int(buf.ctypes.data)
        eng.register_memory(at, 64)
        fake.last_error = "link down"
        fake.answers["batch_transfer_sync_read"] = -2
        assert eng.batch_transfer_sync_read("h:1", [at], [0x5000], [64]) == (
            TransferResult.BACKEND)
        assert eng.last_error == (
            "BACKEND: MemFabric batch_transfer_sync_read returned -2: link down")
    finally:
        eng.close()

    class NoEnum(_FakeMooncake):
        TransDataOpType = object  # type: ignore[assignment]

    with pytest.raises(EngineConfigError) as cfg:
        _memfabric(NoEnum(), role="decode")
    assert str(cfg.value) == "MemFabric data_op_type 'SDMA' is not one of []"


# --------------------------------------------------------------------------- host engine API


def _mode_and_reason(mode: str) -> tuple[str, str]:
    eng = HostEngine(mode=mode)
    try:
        return eng.mode, eng.mode_reason
    finally:
        eng.close()


def test_host_engine_modes_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode is validated, and the engine says why it reads the way it does."""
    with pytest.raises(EngineConfigError) as info:
        HostEngine(mode="rdma")
    assert str(info.value) == "host engine mode must be auto, cma or shm, not 'rdma'"
    assert _mode_and_reason("shm") == ("shm", "forced shm")
    monkeypatch.setattr(host_mod, "cma_status", lambda: (False, "yama ptrace_scope=3"))
    with pytest.raises(EngineUnavailable) as info:
        HostEngine(mode="cma")
    assert str(info.value) == "host engine: CMA is not permitted here (yama ptrace_scope=3)"
    assert _mode_and_reason("auto") == ("shm", "yama ptrace_scope=3")
    monkeypatch.setattr(host_mod, "cma_status", lambda: (True, "no Yama LSM"))
    assert _mode_and_reason("auto") == _mode_and_reason("cma") == ("cma", "no Yama LSM")


def test_host_engine_serves_one_address_and_refuses_use_after_close() -> None:
    eng = HostEngine(timeout=1.0)
    try:
        assert eng.session_id == ""
        session = eng.initialize("127.0.0.1")
        port = int(session.rsplit(":", 1)[1])
        assert session == eng.session_id == f"127.0.0.1:{port}"
        assert eng.initialize("127.0.0.1") == session  # again: the same listener
        assert eng.initialize("127.0.0.1", port) == session
        with pytest.raises(EngineConfigError) as info:
            eng.initialize("127.0.0.1", port + 1)
        assert str(info.value) == (f"host engine already serves {session}; cannot also serve "
                                   f"127.0.0.1:{port + 1}")
        with pytest.raises(EngineConfigError, match="already serves"):
            eng.initialize("localhost", port)
        other = HostEngine()
        try:
            with pytest.raises(EngineConfigError,
                               match=f"^host engine cannot listen on 127.0.0.1:{port}: "):
                other.initialize("127.0.0.1", port)
        finally:
            other.close()
        with pytest.raises(RegistrationError, match="^cannot allocate 0 bytes$"):
            eng.allocate(0)
    finally:
        eng.close()
    for use in (lambda: eng.initialize("127.0.0.1"), lambda: eng.allocate(64),
                lambda: eng.register_memory(0x1000, 64)):
        with pytest.raises(EngineError, match="^host engine is closed$"):
            use()
    assert eng.batch_transfer_sync_read(session, [1], [1], [1]) == TransferResult.CLOSED
    assert eng.last_error == "CLOSED: host engine is closed"


def test_host_engine_serves_ipv6_sessions_in_brackets() -> None:
    owner, reader = HostEngine(timeout=2.0), HostEngine(timeout=2.0)
    try:
        session = owner.initialize("::1")
        assert session.startswith("[::1]:")
        src = pattern(4096, 9).copy()
        owner.register_memory(int(src.ctypes.data), src.nbytes)
        dst, base = _dest(reader, 4096)
        assert reader.batch_transfer_sync_read(session, [base], [int(src.ctypes.data)],
                                               [4096]) == 0, reader.last_error
        np.testing.assert_array_equal(dst, src)
    finally:
        reader.close()
        owner.close()


# --------------------------------------------------------------------------- shared checks


@pytest.mark.parametrize(("session", "parsed"), [
    ("127.0.0.1:5000", ("127.0.0.1", 5000)),
    ("[::1]:1", ("::1", 1)),
    ("host.example:65535", ("host.example", 65535)),
    ("h:0", None), ("h:65536", None), (":5000", None), ("h:", None), ("h:-1", None),
    ("h5000", None), ("h:50a", None), ("[]:80", None), (5000, None), (None, None),
])
def test_a_session_is_host_colon_port(session: Any, parsed: Any) -> None:
    from sfa_rd2h.runtime.engines.base import parse_session

    assert parse_session(session) == parsed


def test_a_region_is_a_positive_range_inside_the_address_space() -> None:
    from sfa_rd2h.runtime.engines.base import RegionSet, check_region

    assert check_region(1, 2**64 - 2) == (1, 2**64 - 2)  # ends at the last byte
    for addr, n, text in ((0, 8, "invalid region: addr=0x0 length=8"),
                          (16, 0, "invalid region: addr=0x10 length=0"),
                          (-16, 8, "invalid region: addr=-0x10 length=8"),
                          (16, -1, "invalid region: addr=0x10 length=-1"),
                          (2, 2**64 - 2, f"invalid region: addr=0x2 length={2**64 - 2}")):
        with pytest.raises(RegistrationError) as info:
            check_region(addr, n)
        assert str(info.value) == text
    with pytest.raises(RegistrationError, match="^region address and length must be integers"):
        check_region("0x10", 8)  # type: ignore[arg-type]
    regions = RegionSet()
    assert regions.add(0x1000, 0x100) is True
    assert regions.add(0x1000, 0x100) is False  # the same region again
    with pytest.raises(RegistrationError) as info:
        regions.add(0x1000, 0x200)
    assert str(info.value) == ("region 0x1000 is already registered with 256 bytes, not 512; "
                               "unregister it first")
    with pytest.raises(RegistrationError) as info:
        regions.add(0x10ff, 1)
    assert str(info.value) == "region [0x10ff, +1) overlaps the registered region [0x1000, +256)"
    assert regions.add(0x1100, 1) and regions.add(0xfff, 1)  # touching is not overlapping
    assert regions.snapshot() == ([0xfff, 0x1000, 0x1100], [1, 0x100, 1]) and len(regions) == 3
    assert regions.remove(0x1000) == 0x100
    with pytest.raises(RegistrationError, match=r"^no region is registered at 0x1000$"):
        regions.remove(0x1000)
    table = regions.table()
    assert len(table) == 2
    assert table.first_outside([0xfff, 0x1100], [1, 1]) is None
    assert table.first_outside([0xfff, 0x1000], [1, 1]) == 1


def test_a_refused_batch_says_which_descriptor_and_why() -> None:
    eng = HostEngine()
    try:
        dst, base = _dest(eng, 64)
        assert eng.batch_transfer_sync_read("h:1", [base, base + 60], [0, 0], [8, 8]) == (
            TransferResult.LOCAL_RANGE)
        assert eng.last_error == (
            f"LOCAL_RANGE: descriptor 1: destination [0x{base + 60:x}, +8) is not inside "
            "memory registered with the host engine")
        many = np.full(20, base, dtype=np.uint64)  # the array path says it alike
        many[7] = base + 64
        assert eng.batch_transfer_sync_read("h:1", many, many, np.ones(20, np.uint64)) == (
            TransferResult.LOCAL_RANGE)
        assert eng.last_error == (
            f"LOCAL_RANGE: descriptor 7: destination [0x{base + 64:x}, +1) is not inside "
            "memory registered with the host engine")
        assert eng.batch_transfer_sync_read("h1", [base], [0], [8]) == TransferResult.BAD_SESSION
        assert eng.last_error == "BAD_SESSION: 'h1' is not host:port"
        assert eng.batch_transfer_sync_read("h:1", [base], [0], [8, 8]) == (
            TransferResult.BAD_DESCRIPTORS)
        assert eng.last_error == ("BAD_DESCRIPTORS: descriptor arrays differ in length: "
                                  "local=1 peer=1 lengths=2")
        assert (dst == SENTINEL).all()
    finally:
        eng.close()


@pytest.mark.parametrize("small", [True, False], ids=["python-ints", "arrays"])
@pytest.mark.parametrize(("errno_name", "code"), [
    ("ESRCH", TransferResult.PEER_GONE), ("EPERM", TransferResult.NOT_PERMITTED),
    ("EFAULT", TransferResult.COPY_FAILED), (None, TransferResult.COPY_FAILED)])
def test_a_failed_copy_is_a_failure_that_says_why(
        monkeypatch: pytest.MonkeyPatch, small: bool, errno_name: str | None,
        code: TransferResult) -> None:
    """F2: whatever the kernel answers to the copy (the peer is gone, access refused, a bad
    address, fewer bytes than asked), the read fails with the matching code and reason."""
    import errno

    owner, other, src, addr = _serving_pair()
    try:
        count = 2 if small else 20  # the small-batch path or the array path
        dst, base = _dest(other, 128 * count)
        local = [base + 128 * i for i in range(count)]  # gaps: nothing coalesces
        peer = [addr + 64 * i for i in range(count)]
        assert other.batch_transfer_sync_read(owner.session_id, local, peer,
                                              [64] * count) == 0
        err = getattr(errno, errno_name) if errno_name else 0
        monkeypatch.setattr(host_mod, "_readv", lambda *a: (-1 if err else 10, err))
        dst.fill(SENTINEL)
        assert other.batch_transfer_sync_read(owner.session_id, local, peer,
                                              [64] * count) == code
        pid = os.getpid()
        why = {"ESRCH": f"peer process {pid} is gone",
               "EPERM": f"kernel refused process_vm_readv on pid {pid} ({cma_status()[1]})",
               "EFAULT": os.strerror(errno.EFAULT),
               None: f"short read: 10 of {64 * count} bytes"}[errno_name]
        assert other.last_error == f"{code.name}: {why}"
    finally:
        other.close()
        owner.close()


def _stale(reply: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    return {**reply, key: value}


@pytest.mark.parametrize(("tamper", "why"), [
    (lambda r: _stale(r, "v", 2), "unusable registry reply from {s}: not a version-1 registry "
                                  "reply"),
    (lambda r: {"error": "busy"}, "registry at {s} refused: busy (" + host_mod.ACROSS_HOSTS +
                                  ")"),
    (lambda r: {"error": 7}, "unusable registry reply from {s}: not a version-1 registry "
                             "reply"),
    (lambda r: _stale(r, "boot", "another-boot"), "{s} runs on another host: " +
                                                  host_mod.ACROSS_HOSTS),
    (lambda r: _stale(r, "pidns", r["pidns"] + 1),
     "registry at {s} refused: it says it is in another pid namespace, but pid {pid} of this "
     "one holds the registry socket that answered"),
    (lambda r: _stale(r, "lens", r["lens"][1:]), "unusable registry reply from {s}: ranges and "
                                                 "lengths differ in count"),
    (lambda r: _stale(r, "pid", 0), "registry at {s} refused: it names no valid pid (0)"),
    (lambda r: _stale(r, "pid", "1"), "registry at {s} refused: it names no valid pid ('1')"),
    (lambda r: _stale(r, "pid", os.getppid()), "registry at {s} refused: pid {ppid} does not "
                                               "hold the registry socket that answered"),
    (lambda r: _stale(r, "ctl", "sfa_rd2h.1.0.ctl"), "registry at {s} refused: segments "
                                                     "['sfa_rd2h.1.0.ctl'] are not pid {pid}'s"),
    (lambda r: _stale(r, "pid", 1), "registry at {s} refused: pid 1 does not hold the registry "
                                    "socket that answered"),
    (lambda r: _stale(r, "shm", [["sfa_rd2h.1.0.1", 4096, 64]]),
     "registry at {s} refused: segments ['sfa_rd2h.1.0.1'] are not pid {pid}'s"),
    (lambda r: {**r, "ctl": "c", "shm": [["s1", 1, 1], ["s2", 2, 2], ["s3", 3, 3]]},
     "registry at {s} refused: segments ['c', 's1', 's2'] are not pid {pid}'s"),
    (lambda r: _stale(r, "ctl", f"sfa_rd2h.{r['pid']}.0.ctl/../x"),
     "unusable registry reply from {s}: refusing shm name 'sfa_rd2h.{pid}.0.ctl/../x'"),
], ids=["version", "refusal", "refusal-not-text", "boot", "pidns", "lens", "pid-0", "pid-str",
        "pid-other", "ctl", "pid-1", "shm", "first-three", "ctl-name"])
def test_a_registry_answer_that_cannot_be_used_is_named(
        tamper: Any, why: str, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever is wrong with a registry's answer, the read fails as unreachable and says
    what was wrong, and nothing is copied."""
    owner, other, src, addr = _serving_pair()
    try:
        dst, base = _dest(other, 64)
        assert owner._server is not None
        honest = owner._describe
        owner._server._describe = lambda: tamper(honest())
        with caplog.at_level("WARNING", logger=host_mod.__name__):
            ret = other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64])
        assert ret == TransferResult.PEER_UNREACHABLE
        text = why.format(s=owner.session_id, pid=os.getpid(), ppid=os.getppid())
        assert other.last_error == f"PEER_UNREACHABLE: {text}"
        prefix = f"registry at {owner.session_id} refused: "
        assert [r.getMessage() for r in caplog.records] == (  # a refusal is worth a warning
            [f"host engine refuses {owner.session_id}: {text[len(prefix):]}"]
            if text.startswith(prefix) else [])
        assert (dst == SENTINEL).all()
    finally:
        other.close()
        owner.close()


def test_the_registry_answers_only_describe() -> None:
    eng = HostEngine(timeout=2.0)
    try:
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as c:
            c.settimeout(2.0)
            host_mod._send_frame(c, {"op": "dump"})
            assert host_mod._recv_frame(c) == {
                "error": "unknown request; expected {'op': 'describe'}"}
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as c:
            c.settimeout(2.0)
            host_mod._send_frame(c, {"op": "describe"})
            reply = host_mod._recv_frame(c)
        assert reply["v"] == 1 and reply["pid"] == os.getpid()
        assert reply["ctl"].startswith(f"sfa_rd2h.{os.getpid()}.")
        assert reply["addrs"] == [] and reply["lens"] == [] and reply["shm"] == []
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["cma", "shm"])
def test_what_a_reader_may_read_of_a_peer_in_this_process(mode: str) -> None:
    """Only what the peer registered (in shm mode: allocated) is read, each refusal names
    the descriptor and the reason, the reader follows the peer's later registrations and
    withdrawals, and a closed peer is gone."""
    owner, reader = HostEngine(mode=mode, timeout=2.0), HostEngine(mode=mode, timeout=2.0)
    try:
        s = owner.initialize("127.0.0.1")
        addr, arr = owner.allocate(8192)
        arr[:] = pattern(8192, 3)
        dst, base = _dest(reader, 8192)
        assert reader.batch_transfer_sync_read(s, [base, base + 4096], [addr + 4096, addr],
                                               [4096, 4096]) == 0, reader.last_error
        np.testing.assert_array_equal(dst[:4096], arr[4096:])
        np.testing.assert_array_equal(dst[4096:], arr[:4096])
        dst.fill(SENTINEL)
        ret = reader.batch_transfer_sync_read(s, [base, base + 64], [addr, addr + 8190], [64, 4])
        assert ret == TransferResult.PEER_RANGE
        assert reader.last_error == (f"PEER_RANGE: descriptor 1: source [0x{addr + 8190:x}, +4)"
                                     f" is not inside memory {s} registered")
        plain = pattern(4096, 4).copy()
        owner.register_memory(int(plain.ctypes.data), 4096)  # after the reader cached it
        ret = reader.batch_transfer_sync_read(s, [base], [int(plain.ctypes.data)], [64])
        if mode == "cma":
            assert ret == 0, reader.last_error
            np.testing.assert_array_equal(dst[:64], plain[:64])
            dst.fill(SENTINEL)
        else:
            assert ret == TransferResult.PEER_RANGE
            assert reader.last_error == (
                f"PEER_RANGE: descriptor 0: source 0x{int(plain.ctypes.data):x} is not in a "
                f"shm segment of {s} (shm mode reads only memory the peer allocate()d)")
        later, more = owner.allocate(4096)
        more[:] = 9
        assert reader.batch_transfer_sync_read(s, [base], [later], [4096]) == 0
        assert (dst[:4096] == 9).all()
        owner.unregister_memory(later)
        dst.fill(SENTINEL)
        assert reader.batch_transfer_sync_read(s, [base], [later], [64]) == (
            TransferResult.PEER_RANGE)
        assert reader.last_error == (f"PEER_RANGE: descriptor 0: source [0x{later:x}, +64) is "
                                     f"not inside memory {s} registered")
        owner.close()
        assert reader.batch_transfer_sync_read(s, [base], [addr], [64]) == (
            TransferResult.PEER_GONE)
        assert reader.last_error == "PEER_GONE: peer closed its engine"
        assert (dst == SENTINEL).all()
    finally:
        reader.close()
        owner.close()


def test_a_small_batch_is_one_syscall_of_coalesced_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's few descriptors go to the kernel as one process_vm_readv, runs contiguous on
    both sides merged into one iovec; a piece over the per-iovec cap or a batch at the byte
    window takes the bounded split instead."""
    owner, other, src, addr = _serving_pair()
    syscalls = _record_syscalls(monkeypatch)
    try:
        dst, b = _dest(other, 4096)

        def read(local: list[int], peer: list[int], n: list[int]) -> list[list[int]]:
            syscalls.clear()
            dst.fill(SENTINEL)
            assert other.batch_transfer_sync_read(owner.session_id, [b + x for x in local],
                                                  [addr + x for x in peer], n) == 0
            for x, y, k in zip(local, peer, n, strict=True):
                np.testing.assert_array_equal(dst[x:x + k], src[y:y + k])
            return syscalls

        assert read([0, 64, 512], [0, 64, 128], [64, 64, 32]) == [[128, 32]]
        assert read([0, 64], [64, 0], [64, 64]) == [[64, 64]]  # contiguous on one side only
        assert read([0, 100], [0, 200], [100, 50]) == [[100, 50]]
        monkeypatch.setattr(host_mod, "_PIECE_BYTES", 64)
        assert read([0], [0], [64]) == [[64]]
        assert read([0], [0], [100]) == [[64, 36]]  # over the cap: split in pieces
        monkeypatch.setattr(host_mod, "_PIECE_BYTES", 1 << 20)
        monkeypatch.setattr(host_mod, "_GROUP_BYTES", 256)
        assert read([0], [0], [255]) == [[255]]
        assert read([0, 255], [0, 1024], [1, 254]) == [[1, 254]]  # 255 bytes: one call
        # From 256 bytes on, a syscall covers the pieces starting in one 256-byte window.
        assert read([0, 512], [0, 1024], [300, 10]) == [[300], [10]]
    finally:
        other.close()
        owner.close()


def test_under_yama_scope_1_the_owner_names_its_ptracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Yama scope 1 without CAP_SYS_PTRACE: a CMA owner declares, once it serves, the one
    process whose descendants may read it (PR_SET_PTRACER); otherwise it declares nothing."""
    from types import SimpleNamespace

    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(host_mod, "_libc", SimpleNamespace(
        prctl=lambda op, pid, *rest: calls.append((op, pid.value, *rest)) or 0))
    monkeypatch.setattr(host_mod, "cma_status", lambda: (True, "yama ptrace_scope=1"))
    monkeypatch.setenv("SFA_RD2H_PTRACER", "4321")
    for scope, cap, mode, declared in ((1, False, "cma", True), (1, True, "cma", False),
                                       (0, False, "cma", False), (None, False, "cma", False),
                                       (2, False, "cma", False), (1, False, "shm", False)):
        monkeypatch.setattr(host_mod, "_ptrace_scope", lambda s=scope: s)
        monkeypatch.setattr(host_mod, "_has_cap_sys_ptrace", lambda c=cap: c)
        calls.clear()
        eng = HostEngine(mode=mode)
        try:
            assert calls == []  # nothing before it serves
            eng.initialize("127.0.0.1")
            assert calls == ([(0x59616D61, 4321, 0, 0, 0)] if declared else []), (scope, cap, mode)
        finally:
            eng.close()


# --------------------------------------------------------------------------- host facts and wire
# What the host engine reads from /proc and from a registry connection, against inputs the
# machine running the tests may not offer (a command name with parentheses, a kernel without
# Yama, a capability set without CAP_SYS_PTRACE, a registry that hangs up).


def _fake_files(monkeypatch: pytest.MonkeyPatch, files: dict[str, str | bytes]) -> None:
    """``open`` in the host engine module sees exactly ``files``; anything else is missing."""
    import io

    def fake_open(path: str, mode: str = "r") -> Any:
        if path not in files:
            raise FileNotFoundError(path)
        data = files[path]
        if isinstance(data, Exception):
            raise data
        return io.BytesIO(data) if "b" in mode else io.StringIO(data)  # type: ignore[arg-type]

    monkeypatch.setattr(host_mod, "open", fake_open, raising=False)


def test_a_process_start_time_is_field_22_whatever_the_command_name() -> None:
    stat = f"/proc/{os.getpid()}/stat"
    with open(stat, "rb") as f:
        fields = f.read().rpartition(b") ")[2].split()  # fields from the 3rd (state) on
    assert host_mod._proc_start_time(os.getpid()) == int(fields[22 - 3])
    mp_ = pytest.MonkeyPatch()
    try:
        # A command name may hold ") " itself; fields 3.. follow the last ')'.
        rest = " ".join(["S"] + [str(k) for k in range(4, 53)])
        _fake_files(mp_, {"/proc/77/stat": f"77 (a) b) c) {rest}\n".encode(),
                          "/proc/78/stat": b"78 (x) S 1 2\n",
                          "/proc/79/stat": b"79 (x) S" + b" z" * 30 + b"\n"})
        assert host_mod._proc_start_time(77) == 22
        assert host_mod._proc_start_time(78) is None  # too few fields
        assert host_mod._proc_start_time(79) is None  # not a number
        assert host_mod._proc_start_time(80) is None  # no such process
    finally:
        mp_.undo()


@pytest.mark.parametrize(("status", "cap"), [
    ("Name:\tx\nCapEff:\t0000000000080000\nCapBnd:\t0\n", True),  # bit 19 alone
    ("CapEff:\t000001fffeffffff\n", True),  # a root container's set
    ("CapEff:\t000001fffff7ffff\n", False),  # everything but CAP_SYS_PTRACE
    ("CapEff:\t0000000000100000\n", False),  # bit 20 (CAP_SYS_PACCT) only
    ("CapPrm:\t0000000000080000\n", False),  # no effective set listed
    ("CapEff:\n", False), ("CapEff:\tzz\n", False), (OSError("no /proc"), False),
], ids=["bit19", "root", "all-but-19", "bit20", "no-capeff", "empty", "garbage", "unreadable"])
def test_cap_sys_ptrace_is_bit_19_of_the_effective_set(
        monkeypatch: pytest.MonkeyPatch, status: Any, cap: bool) -> None:
    _fake_files(monkeypatch, {"/proc/self/status": status})
    assert host_mod._has_cap_sys_ptrace() is cap


def test_ptrace_scope_is_read_from_yama_or_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    path = "/proc/sys/kernel/yama/ptrace_scope"
    for text, scope in (("1\n", 1), ("3", 3), ("x\n", None)):
        _fake_files(monkeypatch, {path: text})
        assert host_mod._ptrace_scope() == scope
    _fake_files(monkeypatch, {})  # no Yama LSM
    assert host_mod._ptrace_scope() is None


def test_the_registry_address_check_strips_ipv4_mapped_prefixes() -> None:
    """A dual-stack registry sees IPv4 readers as ::ffff:a.b.c.d: they are judged by their
    IPv4 address; loopback and a reader on the registry's own address are local."""
    class Conn:
        def __init__(self, peer: str, mine: str) -> None:
            self.peer, self.mine = peer, mine

        def getpeername(self) -> tuple[str, int]:
            if not self.peer:
                raise OSError("not connected")
            return (self.peer, 5555)

        def getsockname(self) -> tuple[str, int]:
            return (self.mine, 4000)

    for peer, mine, local in (
        ("::ffff:127.0.0.1", "::ffff:10.0.0.1", True),  # loopback, seen through IPv6
        ("10.0.0.7", "::ffff:10.0.0.7", True),  # the registry's own address
        ("::ffff:10.0.0.7", "10.0.0.7", True),
        ("::ffff:10.0.0.8", "::ffff:10.0.0.7", False),
        ("127.0.0.5", "10.0.0.1", True),
        ("10.0.0.7", "10.0.0.7", True),
        ("::1", "2001:db8::1", True),
        ("2001:db8::2", "2001:db8::1", False),
        ("", "127.0.0.1", False),  # the reader already went away
    ):
        assert host_mod._is_local_client(Conn(peer, mine)) is local, (peer, mine)  # type: ignore[arg-type]


def test_a_registry_frame_is_bounded_and_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    import struct

    import msgpack

    monkeypatch.setattr(host_mod, "_MAX_FRAME", 8)
    a, b = socket.socketpair()
    with a, b:
        body = msgpack.packb("1234567")  # 8 bytes: exactly the bound
        a.sendall(struct.pack(">I", len(body)) + body)
        assert host_mod._recv_frame(b) == "1234567"
        body = msgpack.packb("12345678")
        a.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(ValueError) as info:
            host_mod._recv_frame(b)
        assert str(info.value) == "registry frame of 9 bytes exceeds 8"
        b.recv(9)
        a.sendall(b"\xff\xff\xff\xff")  # a length with the top bit set is still unsigned
        with pytest.raises(ValueError) as info:
            host_mod._recv_frame(b)
        assert str(info.value) == "registry frame of 4294967295 bytes exceeds 8"
        a.sendall(struct.pack(">I", 3) + b"ab")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError) as info2:
            host_mod._recv_frame(b)
        assert str(info2.value) == "peer closed the registry connection"


def test_a_registry_frame_arriving_in_pieces_is_assembled_in_order() -> None:
    class Trickle:
        """A connection that delivers at most 3 bytes per receive."""

        def __init__(self, data: bytes) -> None:
            self.data = data

        def recv_into(self, view: memoryview) -> int:
            k = min(3, len(view), len(self.data))
            view[:k], self.data = self.data[:k], self.data[k:]
            return k

    body = b"0123456789abcdefghij"
    import struct

    assert host_mod._recv_frame(Trickle(struct.pack(">I", 3) + b"\xa2hi")) == "hi"  # type: ignore[arg-type]
    assert host_mod._recv_exact(Trickle(body), 20) == body  # type: ignore[arg-type]


@pytest.mark.parametrize(("answer", "why"), [
    (b"", "peer closed the registry connection"),
    (b"\x00\x00\x00\x10short", "peer closed the registry connection"),
    (b"\x7f\x00\x00\x00", f"registry frame of {0x7F000000} bytes exceeds {host_mod._MAX_FRAME}"),
], ids=["hang-up", "cut-short", "oversized"])
def test_a_registry_that_hangs_up_or_oversends_is_unreachable(answer: bytes, why: str) -> None:
    import threading

    reader = HostEngine(timeout=2.0)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        session = f"127.0.0.1:{srv.getsockname()[1]}"

        def answer_once() -> None:
            conn, _ = srv.accept()
            with conn:
                host_mod._recv_frame(conn)
                conn.sendall(answer)

        t = threading.Thread(target=answer_once)
        t.start()
        try:
            dst, base = _dest(reader, 64)
            ret = reader.batch_transfer_sync_read(session, [base], [base], [16])
            assert ret == TransferResult.PEER_UNREACHABLE
            assert reader.last_error == (
                f"PEER_UNREACHABLE: no registry answers at {session}: {why}")
            assert (dst == SENTINEL).all()
        finally:
            t.join(5)
            reader.close()


def test_a_peer_shm_file_is_mapped_only_by_its_own_name_and_size() -> None:
    import secrets

    with pytest.raises(ValueError) as info:
        host_mod._map_readonly("sfa_rd2h.1.ab.ctl/../../etc/passwd", 16)
    assert str(info.value) == "refusing shm name 'sfa_rd2h.1.ab.ctl/../../etc/passwd'"
    name = f"sfa_rd2h.{os.getpid()}.{secrets.token_hex(6)}.1"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(bytes(range(16)))
    try:
        with pytest.raises(ValueError) as info:
            host_mod._map_readonly(name, 17)
        assert str(info.value) == f"{name} holds 16 bytes, peer advertised 17"
        mm, arr = host_mod._map_readonly(name, 16)  # exactly its size
        assert arr.dtype == np.uint8 and arr.tolist() == list(range(16))
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1
        del arr
        mm.close()
    finally:
        os.unlink(path)


def test_files_that_cannot_be_removed_are_logged_and_forgotten(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    stuck = tmp_path / "a-directory"
    stuck.mkdir()
    gone = tmp_path / "gone"
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    paths = [str(gone), str(stuck), str(plain)]
    with caplog.at_level("WARNING", logger=host_mod.__name__):
        host_mod._unlink_all(paths)
    assert paths == [] and not plain.exists() and stuck.exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"could not remove {stuck}: [Errno 21] Is a directory: '{stuck}'"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]


# --------------------------------------------------------------------------- the registry server


def _ask(port: int, request: Any = None, raw: bytes | None = None) -> socket.socket:
    """A registry client that sends one request (or raw bytes) and leaves the line open."""
    c = socket.create_connection(("127.0.0.1", port), timeout=10.0)
    if raw is not None:
        c.sendall(raw)
    else:
        host_mod._send_frame(c, request if request is not None else {"op": "describe"})
    return c


def _closed_by_registry_within(c: socket.socket, seconds: float) -> bool:
    c.settimeout(seconds)
    try:
        while c.recv(65536):
            pass  # the answer, then the end of the line
        return True
    except ConnectionResetError:  # closed with our request unread
        return True
    except TimeoutError:
        return False


def test_the_registry_drops_a_failed_client_at_once_and_keeps_an_answered_one_a_while(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An answered line stays open for its reader to verify the answer, up to the I/O
    bound; a client that sent garbage is not kept at all, and the reason is logged."""
    monkeypatch.setattr(host_mod, "REGISTRY_IO_S", 30.0)
    eng = HostEngine(timeout=30.0)
    try:
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        answered = _ask(port)
        assert host_mod._recv_frame(answered)["pid"] == os.getpid()
        with caplog.at_level("DEBUG", logger=host_mod.__name__):
            garbage = _ask(port, raw=b"\xff\xff\xff\xffgarbage")
            assert _closed_by_registry_within(garbage, 10.0)
        assert [r.getMessage() for r in caplog.records] == [
            f"registry client dropped: registry frame of 4294967295 bytes exceeds "
            f"{host_mod._MAX_REQUEST}"]
        assert not _closed_by_registry_within(answered, 0.2)  # still lingering
        answered.shutdown(socket.SHUT_WR)  # the reader is done with it: the registry lets go
        assert _closed_by_registry_within(answered, 10.0)
        garbage.close()
        answered.close()
    finally:
        eng.close()
    eng = HostEngine(timeout=1.0)
    try:
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        answered = _ask(port)
        assert host_mod._recv_frame(answered)["pid"] == os.getpid()
        t0 = time.monotonic()
        assert _closed_by_registry_within(answered, 10.0)  # the reader never closed it
        assert 0.5 < time.monotonic() - t0 < 5.0
        answered.close()
        with _ask(port) as again:  # and the registry goes on answering
            assert host_mod._recv_frame(again)["pid"] == os.getpid()
    finally:
        eng.close()


def _trickle(sock: socket.socket, stop: threading.Event) -> None:
    """Send a byte every 0.1 s (well inside any receive timeout here) until ``stop`` or the
    other end gives up: a peer that is slow but never silent."""
    try:
        while not stop.wait(0.1):
            sock.sendall(b"\x90")
    except OSError:
        pass


def _read_back(owner: HostEngine, src: np.ndarray) -> None:
    """A fresh reader of ``owner`` copies ``src`` (registered there) whole."""
    reader = HostEngine(mode="cma", timeout=5.0)
    try:
        dst, base = _dest(reader, src.nbytes)
        assert reader.batch_transfer_sync_read(owner.session_id, [base],
                                               [int(src.ctypes.data)], [src.nbytes]) == 0, \
            reader.last_error
        assert (dst == src).all()
    finally:
        reader.close()


def test_a_trickling_registry_client_is_cut_at_its_deadline_and_others_are_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends its request a byte now and then, each within the per-receive
    timeout, is cut once the whole request's time is up, and an honest reader is served
    after it. Before, each byte restarted the clock: one such client held the registry's
    only thread, and every reader of that Prefill failed meanwhile. A request frame larger
    than any request is refused before it is read."""
    import struct

    monkeypatch.setattr(host_mod, "REGISTRY_IO_S", 0.5)
    eng = HostEngine(timeout=5.0)
    stop = threading.Event()
    try:
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        src = pattern(4096, 6).copy()
        eng.register_memory(int(src.ctypes.data), src.nbytes)
        slow = _ask(port, raw=struct.pack(">I", 100))
        threading.Thread(target=_trickle, args=(slow, stop), daemon=True).start()
        _read_back(eng, src)
        assert _closed_by_registry_within(slow, 10.0)
        with _ask(port, raw=struct.pack(">I", host_mod._MAX_REQUEST + 1)) as big:
            assert _closed_by_registry_within(big, 10.0)
            assert big.recv(1) == b""  # no answer: dropped unread
    finally:
        stop.set()
        eng.close()


def test_a_registry_that_answers_a_byte_at_a_time_fails_the_read_at_the_deadline() -> None:
    """The reader's registry round trip is bounded as a whole (connect, ask, answer), not
    per receive: a registry that keeps sending a byte now and then fails the read when the
    engine's timeout is up."""
    import struct

    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def registry() -> None:
            conn, _ = listener.accept()
            with conn:
                host_mod._recv_frame(conn)
                conn.sendall(struct.pack(">I", 1000))
                _trickle(conn, stop)

        server = threading.Thread(target=registry, daemon=True)
        server.start()
        reader = HostEngine(mode="cma", timeout=1.0)
        try:
            _, base = _dest(reader, 64)
            t0 = time.monotonic()
            ret = reader.batch_transfer_sync_read(f"127.0.0.1:{port}", [base], [4096], [64])
            took = time.monotonic() - t0
        finally:
            stop.set()
            reader.close()
        server.join(10)
    assert ret == TransferResult.PEER_UNREACHABLE, reader.last_error
    assert reader.last_error.startswith("PEER_UNREACHABLE: no registry answers at "), \
        reader.last_error
    assert took < 5.0, took  # one 1 s timeout and a margin for a loaded box (before: ~100 s)


def test_a_registry_in_this_pid_namespace_that_claims_another_is_refused_in_shm_mode(
        caplog: pytest.LogCaptureFixture) -> None:
    """In shm mode a peer in another pid namespace is read (its pid cannot be checked from
    here), so a registry could claim one to skip the check that its pid holds the socket
    that answered, and point the reader at any process's segments. The process holding
    that socket is visible here and in this namespace: the claim is refused, nothing is
    copied."""
    owner = HostEngine(mode="shm", timeout=2.0)
    reader = HostEngine(mode="shm", timeout=2.0)
    try:
        owner.initialize("127.0.0.1")
        addr, src = owner.allocate(4096)
        src[:] = pattern(4096, 7)
        base, dst = reader.allocate(4096)
        dst.fill(SENTINEL)
        assert owner._server is not None
        honest = owner._describe
        assert reader.batch_transfer_sync_read(owner.session_id, [base], [addr], [4096]) == 0
        assert (dst == src).all()  # the honest answer is read
        reader2 = HostEngine(mode="shm", timeout=2.0)  # no cached view of the owner
        try:
            base2, dst2 = reader2.allocate(4096)
            dst2.fill(SENTINEL)
            owner._server._describe = lambda: {**honest(), "pidns": honest()["pidns"] + 1}
            ret = reader2.batch_transfer_sync_read(owner.session_id, [base2], [addr], [4096])
            assert ret == TransferResult.PEER_UNREACHABLE
            assert reader2.last_error == (
                f"PEER_UNREACHABLE: registry at {owner.session_id} refused: it says it is in "
                f"another pid namespace, but pid {os.getpid()} of this one holds the "
                "registry socket that answered")
            assert (dst2 == SENTINEL).all()
        finally:
            reader2.close()
    finally:
        reader.close()
        owner.close()


def test_the_registry_keeps_at_most_max_lingering_lines_and_closes_them_on_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Answered connections stay open for their readers to verify, at most
    ``_MAX_LINGERING``: one more lets the oldest go, so clients that ask and never close
    cannot make every later reader's check fail (before, the newest was closed at once,
    and its honest reader found the socket orphaned)."""
    monkeypatch.setattr(host_mod, "REGISTRY_IO_S", 30.0)
    monkeypatch.setattr(host_mod, "_MAX_LINGERING", 2)
    eng = HostEngine(timeout=30.0)
    lines: list[socket.socket] = []
    try:
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        for _ in range(3):
            lines.append(_ask(port))
            assert host_mod._recv_frame(lines[-1])["pid"] == os.getpid()
        assert _closed_by_registry_within(lines[0], 10.0)  # one too many: the oldest goes
        assert not _closed_by_registry_within(lines[1], 0.2)
        assert not _closed_by_registry_within(lines[2], 0.2)
        src = pattern(4096, 5).copy()
        eng.register_memory(int(src.ctypes.data), src.nbytes)
        _read_back(eng, src)  # both places held by clients that never close: it verifies
        for c in lines[1:3]:  # their readers are done: the registry lets them go
            c.shutdown(socket.SHUT_WR)
            assert _closed_by_registry_within(c, 10.0)
        for _ in range(2):  # which leaves room for two more
            lines.append(_ask(port))
            assert host_mod._recv_frame(lines[-1])["pid"] == os.getpid()
        assert not _closed_by_registry_within(lines[3], 0.2)
        assert not _closed_by_registry_within(lines[4], 0.2)
        eng.close()
        assert _closed_by_registry_within(lines[3], 10.0)  # stopping lets them go
        assert _closed_by_registry_within(lines[4], 10.0)
    finally:
        eng.close()
        for c in lines:
            c.close()


def test_the_registry_tells_a_remote_client_it_serves_this_host_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng = HostEngine(timeout=2.0)
    reader = HostEngine(timeout=2.0)
    try:
        session = eng.initialize("127.0.0.1")
        monkeypatch.setattr(host_mod, "_is_local_client", lambda conn: False)
        with _ask(int(session.rsplit(":", 1)[1])) as c:
            refusal = host_mod._recv_frame(c)
        assert refusal == {"error": "the host engine serves readers on this host only: " +
                                    host_mod.ACROSS_HOSTS}
        assert "mooncake" in refusal["error"] and "memfabric" in refusal["error"]
        dst, base = _dest(reader, 64)
        assert reader.batch_transfer_sync_read(session, [base], [base], [8]) == (
            TransferResult.PEER_UNREACHABLE)
        # The registry's reason reaches the reader's error whole (it was "not a version-1
        # registry reply" before, which named no cause and no way out).
        assert reader.last_error == (f"PEER_UNREACHABLE: registry at {session} refused: "
                                     f"{refusal['error']}")
    finally:
        reader.close()
        eng.close()


def test_a_registry_that_fails_to_describe_logs_it_and_hangs_up(
        caplog: pytest.LogCaptureFixture) -> None:
    owner, reader = HostEngine(timeout=2.0), HostEngine(timeout=2.0)
    try:
        session = owner.initialize("127.0.0.1")
        assert owner._server is not None
        owner._server._describe = lambda: {}["no such key"]
        dst, base = _dest(reader, 64)
        with caplog.at_level("ERROR", logger=host_mod.__name__):
            ret = reader.batch_transfer_sync_read(session, [base], [base], [8])
        assert ret == TransferResult.PEER_UNREACHABLE
        assert reader.last_error == (f"PEER_UNREACHABLE: no registry answers at {session}: "
                                     "peer closed the registry connection")
        assert [(r.getMessage(), r.exc_info[0] if r.exc_info else None)
                for r in caplog.records] == [("registry failed to answer a client", KeyError)]
        # the registry still answers the next reader
        owner._server._describe = owner._describe
        assert reader.batch_transfer_sync_read(session, [base], [base], [8]) == (
            TransferResult.PEER_RANGE)
    finally:
        reader.close()
        owner.close()


def test_close_is_bounded_and_says_so_when_the_registry_thread_is_stuck(
        caplog: pytest.LogCaptureFixture) -> None:
    """close() waits for the registry thread at most the engine's timeout, and logs when it
    did not stop; a normal close logs nothing."""
    import selectors
    import threading

    eng = HostEngine(timeout=0.5)
    eng.initialize("127.0.0.1")
    with caplog.at_level("WARNING", logger=host_mod.__name__):
        eng.close()
    assert caplog.records == []
    stuck = HostEngine(timeout=0.5)
    port = int(stuck.initialize("127.0.0.1").rsplit(":", 1)[1])
    server = stuck._server
    assert server is not None
    entered, release = threading.Event(), threading.Event()

    def slow_describe() -> dict[str, Any]:
        entered.set()
        release.wait(30)
        raise OSError("released")  # the client is dropped; the thread goes on

    server._describe = slow_describe
    client = _ask(port)
    try:
        assert entered.wait(10)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger=host_mod.__name__):
            stuck.close()
        assert time.monotonic() - t0 < 5.0
        assert [r.getMessage() for r in caplog.records] == [
            "host engine registry thread did not stop within 0.5s"]
    finally:
        # The stopped registry closed its wake-up line; hand its thread another one so it
        # ends once released instead of idling on its closed listener.
        for gone in (server._listener, server._wake_r):
            server._sel.unregister(gone)
        wake_r, wake_w = socket.socketpair()
        server._sel.register(wake_r, selectors.EVENT_READ, "wake")
        wake_w.send(b"x")
        release.set()
        client.close()
        server._thread.join(10)
        server._sel.close()
        wake_r.close()
        wake_w.close()
    assert not server._thread.is_alive()


def test_allocation_sizes_and_an_unwritable_shm_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    eng = HostEngine(mode="shm")
    try:
        addr, arr = eng.allocate(1)  # the smallest region there is
        assert arr.size == 1 and addr == int(arr.ctypes.data)
        assert eng._regions.snapshot() == ([addr], [1])
        missing = str(tmp_path / "no-shm")
        monkeypatch.setattr(host_mod, "_SHM_DIR", missing)
        with pytest.raises(RegistrationError) as info:
            eng.allocate(64)
        name = f"sfa_rd2h.{os.getpid()}.{eng._token}.2"
        assert str(info.value) == (
            f"cannot allocate 64 bytes in {missing}: [Errno 2] No such file or directory: "
            f"'{missing}/{name}'")
        with pytest.raises(EngineUnavailable) as info2:
            HostEngine(mode="shm")
        assert re.fullmatch(
            rf"host engine needs a writable {re.escape(missing)}: \[Errno 2\] No such file or "
            rf"directory: '{re.escape(missing)}/sfa_rd2h\.{os.getpid()}\.[0-9a-f]{{12}}\.ctl'",
            str(info2.value)), str(info2.value)
    finally:
        monkeypatch.undo()
        eng.close()


def test_an_idle_registry_waits_without_spinning_and_wakes_for_each_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle, the registry thread blocks for an hour at a time (it costs nothing); while a
    line lingers it wakes no later than that line's deadline."""
    import selectors
    import threading

    waits: list[float] = []
    changed = threading.Condition()

    class Recording(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        def select(self, timeout: float | None = None) -> Any:
            with changed:
                waits.append(timeout if timeout is not None else float("inf"))
                changed.notify_all()
            return super().select(timeout)

    def idle() -> bool:
        return bool(waits) and waits[-1] > host_mod._IDLE_SELECT_S - 60

    monkeypatch.setattr(selectors, "DefaultSelector", Recording)
    eng = HostEngine(timeout=0.5)
    try:
        port = int(eng.initialize("127.0.0.1").rsplit(":", 1)[1])
        with changed:
            assert changed.wait_for(lambda: len(waits) == 1, timeout=10)
        assert idle(), waits
        with _ask(port) as line:
            assert host_mod._recv_frame(line)["pid"] == os.getpid()
            assert _closed_by_registry_within(line, 10.0)  # after its 0.5 s linger
        with changed:
            assert changed.wait_for(lambda: len(waits) > 2 and idle(), timeout=10), waits
        lingering = waits[1:-1]
        assert lingering and all(0.0 <= w <= 0.5 for w in lingering), waits
    finally:
        eng.close()


def test_a_stalled_client_holds_the_registry_for_its_io_bound_only() -> None:
    """A client that connects and says nothing is given up after the registry's I/O bound,
    so a reader queued behind it is still answered."""
    owner, reader = HostEngine(timeout=0.5), HostEngine(timeout=10.0)
    try:
        session = owner.initialize("127.0.0.1")
        src = pattern(64, 6).copy()
        owner.register_memory(int(src.ctypes.data), 64)
        dst, base = _dest(reader, 64)
        with socket.create_connection(("127.0.0.1", int(session.rsplit(":", 1)[1]))):
            ret = reader.batch_transfer_sync_read(session, [base], [int(src.ctypes.data)], [64])
            assert ret == 0, reader.last_error
        np.testing.assert_array_equal(dst, src)
    finally:
        reader.close()
        owner.close()


def test_an_empty_batch_moves_nothing_and_asks_nobody() -> None:
    eng = HostEngine()
    try:
        dst, base = _dest(eng, 64)
        unreachable = f"127.0.0.1:{_closed_port()}"
        assert eng.batch_transfer_sync_read(unreachable, [], [], []) == 0
        assert eng.batch_transfer_sync_read(unreachable, [base], [base], [0]) == 0
        assert eng.batch_transfer_sync_read(unreachable, np.array([base] * 20, np.uint64),
                                            np.array([base] * 20, np.uint64),
                                            np.zeros(20, np.uint64)) == 0
        assert eng.last_error == "" and (dst == SENTINEL).all()
    finally:
        eng.close()


def test_a_reader_keeps_no_descriptor_of_a_peer_it_no_longer_views() -> None:
    """Each view of a peer holds a pidfd; it is closed when the view is dropped (a refresh,
    a closed reader), so a long-running reader does not accumulate descriptors."""
    import gc

    owner, other, src, addr = _serving_pair()
    try:
        dst, base = _dest(other, 64)
        assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64]) == 0
        gc.collect()
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            owner.unregister_memory(addr)  # each withdrawal makes the reader look again
            owner.register_memory(addr, src.nbytes)
            assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64]) == 0
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        other.close()
        owner.close()


def test_without_pidfds_a_reader_still_notices_an_exited_peer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where pidfds are unavailable, a view compares the peer's start time instead."""
    monkeypatch.setattr(host_mod, "_open_pidfd", lambda pid, start: None)
    owner, other, src, addr = _serving_pair()
    try:
        dst, base = _dest(other, 64)
        assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64]) == 0
        np.testing.assert_array_equal(dst, src[:64])
        assert other._peers[owner.session_id].pidfd is None
        real = host_mod._proc_start_time
        monkeypatch.setattr(host_mod, "_proc_start_time",
                            lambda pid: None if pid == os.getpid() else real(pid))
        dst.fill(SENTINEL)  # as if the pid now belonged to nobody, or somebody else
        assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64]) == (
            TransferResult.PEER_GONE)
        assert other.last_error == f"PEER_GONE: peer process {os.getpid()} has exited"
        assert (dst == SENTINEL).all()
    finally:
        other.close()
        owner.close()


def test_a_cma_reader_ignores_shm_entries_that_name_no_segment() -> None:
    """Only entries that are [name, base, size] lists name a segment to prove; a CMA reader
    maps none of them, so anything else in that list does not stop the read."""
    owner, other, src, addr = _serving_pair()
    try:
        assert owner._server is not None
        honest = owner._describe
        owner._server._describe = lambda: {**honest(), "shm": [[], "", None]}
        dst, base = _dest(other, 64)
        assert other.batch_transfer_sync_read(owner.session_id, [base], [addr], [64]) == 0, (
            other.last_error)
        np.testing.assert_array_equal(dst, src[:64])
    finally:
        other.close()
        owner.close()


def test_a_registration_the_library_refuses_or_raises_on_is_reported_and_not_kept() -> None:
    """Any non-zero answer (positive ones too) comes with the library's diagnostics; an
    exception is reported as -1 with its text; either way the region is not kept."""
    fake = _FakeMooncake()
    eng = _memfabric(fake, role="decode", store_url="tcp://10.0.0.1:6650")
    eng.initialize("127.0.0.1", 7000)
    try:
        buf = np.zeros(64, dtype=np.uint8)
        at = int(buf.ctypes.data)
        fake.last_error = "out of pinned memory"
        fake.answers["register_memory"] = 1
        with pytest.raises(RegistrationError) as info:
            eng.register_memory(at, 64)
        assert str(info.value) == (f"MemFabric register_memory(0x{at:x}, 64) returned 1: "
                                   "out of pinned memory")
        fake.answers["register_memory"] = RuntimeError("no NIC")
        with pytest.raises(RegistrationError) as info:
            eng.register_memory(at, 64)
        assert str(info.value) == f"MemFabric register_memory(0x{at:x}, 64) returned -1: no NIC"
        fake.answers["register_memory"] = 0
        fake.calls.clear()
        eng.register_memory(at, 64)  # neither refusal was kept: the library is asked again
        assert fake.calls == [("register_memory", at, 64)]
    finally:
        eng.close()


@pytest.mark.skipif(sys.byteorder != "little", reason="expected strings are little-endian's")
def test_socket_addresses_are_written_as_the_kernel_lists_them() -> None:
    """/proc/net/tcp{,6} print each 32-bit word of an address in host byte order, unsigned."""
    assert host_mod._kernel_addr(("127.0.0.1", 80)) == "0100007F:0050"
    assert host_mod._kernel_addr(("10.0.0.200", 65535)) == "C800000A:FFFF"
    assert host_mod._kernel_addr(("::1", 8080, 0, 0)) == (
        "00000000000000000000000001000000:1F90")
    assert host_mod._kernel_addr(("::ffff:10.0.0.200", 1, 0, 0)) == (
        "0000000000000000FFFF0000C800000A:0001")


def test_the_registry_socket_is_found_in_the_table_of_its_family(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The answering socket is the table row whose local and remote addresses are the
    client's remote and local ones; IPv6 clients are looked up in tcp6, IPv4 ones in tcp."""
    class Client:
        def __init__(self, mine: tuple, theirs: tuple) -> None:
            self.mine, self.theirs = mine, theirs

        def getsockname(self) -> tuple:
            return self.mine

        def getpeername(self) -> tuple:
            return self.theirs

    v4 = Client(("127.0.0.1", 40000), ("127.0.0.1", 5000))
    v6 = Client(("::1", 40000, 0, 0), ("::1", 5000, 0, 0))
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt uid " \
           "timeout inode\n"
    row4 = "0: {} {} 01 00000000:00000000 00:00000000 00000000 0 0 {} 1 0\n"
    serv4 = host_mod._kernel_addr(("127.0.0.1", 5000))
    cli4 = host_mod._kernel_addr(("127.0.0.1", 40000))
    serv6 = host_mod._kernel_addr(("::1", 5000))
    cli6 = host_mod._kernel_addr(("::1", 40000))
    _fake_files(monkeypatch, {
        "/proc/net/tcp": head + row4.format(cli4, serv4, 111)  # the client's own row
        + f"1: {serv4} {cli4} 01 0 0 0 0 222\n"  # too short to name an inode
        + row4.format(serv4, cli4, 333),
        "/proc/net/tcp6": head + row4.format(serv6, cli6, 666),
    })
    assert host_mod._server_socket_inode(v4) == 333  # type: ignore[arg-type]
    assert host_mod._server_socket_inode(v6) == 666  # type: ignore[arg-type]
    shortest = f"0: {serv4} {cli4} 01 0 0 0 0 0 444\n"  # the shortest row with an inode
    _fake_files(monkeypatch, {"/proc/net/tcp": head + shortest})
    assert host_mod._server_socket_inode(v4) == 444  # type: ignore[arg-type]
    _fake_files(monkeypatch, {"/proc/net/tcp": head + row4.format(cli4, serv4, 111)})
    assert host_mod._server_socket_inode(v4) is None  # type: ignore[arg-type]
    _fake_files(monkeypatch, {"/proc/net/tcp": ""})  # not even a header
    assert host_mod._server_socket_inode(v4) is None  # type: ignore[arg-type]
    _fake_files(monkeypatch, {})
    assert host_mod._server_socket_inode(v4) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [1, 20], ids=["python-ints", "arrays"])
def test_the_kernel_refusing_an_unmapped_source_is_a_failed_copy(count: int) -> None:
    """A peer may register memory that is not mapped (registration cannot tell); the
    kernel's EFAULT then fails the read, with its reason, whichever path copied."""
    import errno

    owner, other, src, addr = _serving_pair()
    try:
        unmapped = 0x1000  # below mmap_min_addr: never mapped in a user process
        owner.register_memory(unmapped, 4096)
        dst, base = _dest(other, 128 * count)
        ret = other.batch_transfer_sync_read(owner.session_id,
                                             [base + 128 * i for i in range(count)],
                                             [unmapped + 128 * i for i in range(count)],
                                             [64] * count)
        assert ret == TransferResult.COPY_FAILED
        assert other.last_error == f"COPY_FAILED: {os.strerror(errno.EFAULT)}"
    finally:
        other.close()
        owner.close()


def test_a_socket_is_held_only_by_a_process_listing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fd that closes while the table is scanned is skipped, not the end of the scan; a
    process whose fd table cannot be listed holds nothing."""
    links = {"/proc/42/fd/3": OSError("closed meanwhile"), "/proc/42/fd/4": "socket:[77]"}

    def readlink(path: str) -> str:
        got = links[path]
        if isinstance(got, Exception):
            raise got
        return got

    def listdir(path: str) -> list[str]:
        if path != "/proc/42/fd":
            raise PermissionError(path)
        return ["3", "4"]

    monkeypatch.setattr(host_mod.os, "readlink", readlink)
    monkeypatch.setattr(host_mod.os, "listdir", listdir)
    assert host_mod._holds_socket(42, 77)
    assert not host_mod._holds_socket(42, 78)
    assert not host_mod._holds_socket(43, 77)  # its fd table is not ours to see


@pytest.mark.parametrize("count", [3, 20], ids=["python-ints", "arrays"])
def test_where_the_syscall_is_filtered_own_memory_is_copied_by_memmove(
        monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """When seccomp filters process_vm_readv even for our own pid, reads from this process
    (shm mode, or a peer in this process) still land every byte, without the syscall."""
    owner, other, src, addr = _serving_pair()
    syscalls = _record_syscalls(monkeypatch)
    monkeypatch.setattr(host_mod, "_self_copy_works", lambda: False)
    try:
        dst, base = _dest(other, 256 * count)
        local = [base + 256 * i for i in range(count)]
        peer = [addr + 100 * i for i in range(count)]
        sizes = [64 + i for i in range(count)]
        assert other.batch_transfer_sync_read(owner.session_id, local, peer, sizes) == 0, (
            other.last_error)
        want = np.full_like(dst, SENTINEL)
        for i in range(count):
            want[256 * i:256 * i + sizes[i]] = src[100 * i:100 * i + sizes[i]]
        np.testing.assert_array_equal(dst, want)
        assert syscalls == []
    finally:
        other.close()
        owner.close()


@pytest.mark.parametrize("count", [2, 20], ids=["python-ints", "arrays"])
def test_a_copy_that_moves_nothing_is_a_short_read(
        monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    owner, other, src, addr = _serving_pair()
    try:
        dst, base = _dest(other, 128 * count)
        monkeypatch.setattr(host_mod, "_readv", lambda *a: (0, 0))
        ret = other.batch_transfer_sync_read(owner.session_id,
                                             [base + 128 * i for i in range(count)],
                                             [addr + 64 * i for i in range(count)], [64] * count)
        assert ret == TransferResult.COPY_FAILED
        assert other.last_error == f"COPY_FAILED: short read: 0 of {64 * count} bytes"
    finally:
        other.close()
        owner.close()
