"""The host engine: real bytes between real processes on one Linux host, no accelerator needed.

It is the default engine for CI, laptops and the demo (PROTOCOL X1). Two data paths:

* **CMA** (cross-memory attach, as MPI and UCX use it): the reader copies straight out of the
  owner's address space with ``process_vm_readv``, batching up to IOV_MAX iovecs per syscall.
  Any memory can be served, including tensors someone else allocated (vLLM's KV caches).
  It needs ptrace permission over the owner, which ``cma_status()`` works out from Yama's
  ``ptrace_scope``, CAP_SYS_PTRACE and a self-test of the syscall.
* **shm**: regions live in ``/dev/shm`` files made by ``HostEngine.allocate``; the reader maps
  the owner's files read-only and copies from its own mapping. Only allocated memory can be
  served (any registered memory can still be a destination). The copy itself is still one
  batched ``process_vm_readv``, against our *own* pid, which is always permitted, so no
  per-block Python loop runs in either mode.

Discovery is a tiny registry service: ``initialize`` opens a TCP listener on ``host:port`` and
a background thread answers ``describe`` with this process's pid, its registered ranges and its
shm segments (msgpack). A reader caches that answer per session and refreshes it once when a
requested range is not covered (the owner may have registered more) or the owner withdrew a
region since. The owner counts withdrawals in a small control file in ``/dev/shm`` that the
reader maps, so detecting a withdrawn region or a closed engine costs a memory load, not a
round trip; a dead peer is caught by comparing the pid's start
time in ``/proc``, so a recycled pid is never read from.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import secrets
import select
import selectors
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from sfa_rd2h.runtime.engines.base import (
    EngineConfigError,
    EngineError,
    EngineUnavailable,
    RangeTable,
    RegionSet,
    RegistrationError,
    TransferEngine,
    TransferResult,
    check_region,
    coalesce,
    parse_session,
)

log = logging.getLogger(__name__)

IOV_MAX = 1024
# The kernel truncates one process_vm_readv to MAX_RW_COUNT (~2 GiB); keeping every syscall
# well below it means a short count always signals a real fault, never a silent cap.
_PIECE_BYTES = 256 << 20
_GROUP_BYTES = 1 << 30
_SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^sfa_rd2h\.[0-9]+\.[0-9a-f]+\.(ctl|[0-9]+)$")
# A registry answer is a few numbers per registered region; decoding one can take ~70x its
# size (a frame of empty arrays), so the bound keeps a hostile answer to tens of MB.
_MAX_FRAME = 1 << 20
_MAX_REQUEST = 4096  # {"op": "describe", "v": 1}, with room to grow
_WIRE_VERSION = 1
_MAX_LINGERING = 64  # answered registry connections kept open for their reader to verify
# Said wherever a reader turns out not to share this host with its peer: the host engine
# copies memory between processes of one machine, so it cannot be the engine across hosts.
ACROSS_HOSTS = ("the host engine reads only processes on its own host (not across hosts or "
                "network namespaces); across hosts use the mooncake (TCP) or memfabric engine")
REGISTRY_TIMEOUT_S = 5.0  # a reader's whole registry round trip (connect, ask, answer)
REGISTRY_IO_S = 2.0  # the registry server: one read or write of a client, and its linger
_IDLE_SELECT_S = 3600.0  # nothing lingers: wait for a client or the wake-up (re-armed hourly)
_CAP_SYS_PTRACE = 19
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_readv = getattr(_libc, "process_vm_readv", None)
if _process_vm_readv is not None:
    _process_vm_readv.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _process_vm_readv.restype = ctypes.c_ssize_t


# --------------------------------------------------------------------------- host facts


def ptracer_pid(setting: str | None = None) -> int:
    """The pid to declare with PR_SET_PTRACER under Yama scope 1: it and its descendants may
    read this process. ``SFA_RD2H_PTRACER`` (or ``setting``) is "parent" (the default: the
    launcher whose children are the readers), a pid (a common ancestor of Prefill and
    Decode), or "any" (every process of this user: the old, wide behaviour)."""
    value = (setting if setting is not None else os.environ.get("SFA_RD2H_PTRACER", "parent"))
    value = value.strip().lower()
    if value == "parent":
        return os.getppid()
    if value == "any":
        return _PR_SET_PTRACER_ANY
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise EngineConfigError(
        f"SFA_RD2H_PTRACER must be 'parent', 'any' or a pid, not {value!r}")


def _ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: classic rules (same uid, or CAP_SYS_PTRACE)


def _has_cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; a recycled pid gets a different one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name may contain spaces and parentheses; fields resume after the last ')'.
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _host_identity() -> tuple[str, int]:
    """(boot id, pid-namespace inode): equal on both sides means pids and /dev/shm are shared."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return boot, pidns


def _kernel_addr(addr: tuple) -> str:
    """``(ip, port, ...)`` as /proc/net/tcp{,6} writes it: the address in host byte order per
    32-bit word, then the port, both in upper-case hex."""
    ip, port = addr[0], int(addr[1])
    if ":" in ip:
        raw = socket.inet_pton(socket.AF_INET6, ip)
        words = struct.unpack("=4I", raw)
        return "".join(f"{w:08X}" for w in words) + f":{port:04X}"
    (word,) = struct.unpack("=I", socket.inet_aton(ip))
    return f"{word:08X}:{port:04X}"


def _server_socket_inode(client: socket.socket) -> int | None:
    """The inode of the socket at the other end of ``client``'s TCP connection, if that end
    lives on this host (in this network namespace); None otherwise."""
    try:
        mine, theirs = client.getsockname(), client.getpeername()
    except OSError:
        return None
    want = (_kernel_addr(theirs), _kernel_addr(mine))
    for table in ("/proc/net/tcp6" if ":" in mine[0] else "/proc/net/tcp",):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and (fields[1], fields[2]) == want:
                        return int(fields[9])
        except (OSError, ValueError):
            return None
    return None


def _holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has the socket ``inode`` open (kernel-verified ownership)."""
    target = f"socket:[{inode}]"
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return True
            except OSError:
                continue
    except OSError:
        return False
    return False


def _socket_holders(inode: int) -> list[int]:
    """Every process visible here that has the socket ``inode`` open."""
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    return [pid for pid in pids if _holds_socket(pid, inode)]


def _pidns_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _is_local_client(conn: socket.socket) -> bool:
    """A registry answers only readers on this host: the host engine never reads remotely,
    and the answer (pid, addresses) is nobody else's business."""
    try:
        peer, mine = conn.getpeername()[0], conn.getsockname()[0]
    except OSError:
        return False
    if peer.startswith("::ffff:"):
        peer = peer[7:]
    if mine.startswith("::ffff:"):
        mine = mine[7:]
    return peer == mine or peer in ("::1",) or peer.startswith("127.")


def _open_pidfd(pid: int, start: int | None) -> int | None:
    """A pidfd for ``pid`` if it is still the process that started at ``start``."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    if _proc_start_time(pid) != start:  # the pid was recycled before we opened it
        os.close(fd)
        return None
    return fd


def _exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (its pidfd polls readable). ``poll``,
    not ``select``: in a process with over 1024 files open (a vLLM worker may be one) the
    pidfd is past what ``select`` takes."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _readv(pid: int, local_iov: int, remote_iov: int, count: int) -> tuple[int, int]:
    assert _process_vm_readv is not None
    got = _process_vm_readv(pid, local_iov, count, remote_iov, count, 0)
    return int(got), (ctypes.get_errno() if got < 0 else 0)


@functools.lru_cache(maxsize=1)
def _self_copy_works() -> bool:
    """Whether process_vm_readv exists and is not filtered (seccomp) for our own pid."""
    if _process_vm_readv is None:
        return False
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    iov = np.array([[dst.ctypes.data, 16], [src.ctypes.data, 16]], dtype=np.uint64)
    got, _ = _readv(os.getpid(), iov.ctypes.data, iov.ctypes.data + 16, 1)
    return got == 16 and bool(np.array_equal(src, dst))


@functools.lru_cache(maxsize=1)
def cma_status() -> tuple[bool, str]:
    """Whether CMA reads between this user's processes are permitted here, and why."""
    if _process_vm_readv is None:
        return False, "libc has no process_vm_readv"
    if not _self_copy_works():
        return False, "process_vm_readv is unavailable (kernel or seccomp filter)"
    scope = _ptrace_scope()
    cap = _has_cap_sys_ptrace()
    if scope is None:
        return True, "no Yama LSM: same-user processes may read each other"
    if scope == 0:
        return True, "yama ptrace_scope=0: same-user processes may read each other"
    if scope == 1:
        if cap:
            return True, "yama ptrace_scope=1 and CAP_SYS_PTRACE"
        return True, ("yama ptrace_scope=1: each owner names the process whose descendants may "
                      "read it (PR_SET_PTRACER, see SFA_RD2H_PTRACER)")
    if scope == 2:
        if cap:
            return True, "yama ptrace_scope=2 and CAP_SYS_PTRACE"
        return False, "yama ptrace_scope=2 needs CAP_SYS_PTRACE, which this process lacks"
    return False, f"yama ptrace_scope={scope} forbids process_vm_readv"


# --------------------------------------------------------------------------- copy kernels


def _split_pieces(
    dst: np.ndarray, src: np.ndarray, n: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if n.size == 0 or int(n.max()) <= _PIECE_BYTES:
        return dst, src, n
    count = ((n + np.uint64(_PIECE_BYTES - 1)) // np.uint64(_PIECE_BYTES)).astype(np.intp)
    owner = np.repeat(np.arange(n.size), count)
    first = np.cumsum(count) - count
    offset = (np.arange(owner.size) - np.repeat(first, count)).astype(np.uint64) * np.uint64(
        _PIECE_BYTES
    )
    lengths = np.minimum(n[owner] - offset, np.uint64(_PIECE_BYTES))
    return dst[owner] + offset, src[owner] + offset, lengths


def _syscall_groups(n: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index ranges, each at most IOV_MAX pieces and ~1 GiB, for one syscall."""
    k = n.size
    if k <= IOV_MAX and int(n.sum()) < _GROUP_BYTES:
        return [(0, k)]  # the common case: every piece starts in the first byte group
    idx = np.arange(k)
    start_bytes = np.cumsum(n) - n
    byte_key = start_bytes // np.uint64(_GROUP_BYTES)
    new_run = np.concatenate(([True], byte_key[1:] != byte_key[:-1]))
    run_start = np.maximum.accumulate(np.where(new_run, idx, 0))
    count_key = (idx - run_start) // IOV_MAX
    boundary = new_run | np.concatenate(([False], count_key[1:] != count_key[:-1]))
    starts = np.flatnonzero(boundary)
    ends = np.append(starts[1:], k)
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _copy(pid: int, dst: np.ndarray | list[int], src: np.ndarray | list[int],
          n: np.ndarray | list[int]) -> tuple[int, str]:
    """Copy ``src[i]`` of process ``pid`` to our ``dst[i]``; returns (0, "") or (errno|-1, why).

    Arrays come coalesced; lists (a small batch, as Python ints) are coalesced here."""
    if isinstance(n, list):
        return _copy_small(pid, dst, src, n)  # type: ignore[arg-type]
    assert isinstance(dst, np.ndarray) and isinstance(src, np.ndarray)
    dst, src, n = _split_pieces(dst, src, n)
    if pid == os.getpid() and not _self_copy_works():
        # Last resort when seccomp filters the syscall: plain memmove per (coalesced) range.
        for d, s, ln in zip(dst.tolist(), src.tolist(), n.tolist(), strict=True):
            ctypes.memmove(d, s, ln)
        return 0, ""
    iov = np.empty((2, n.size, 2), dtype=np.uint64)
    iov[0, :, 0] = dst
    iov[1, :, 0] = src
    iov[:, :, 1] = n
    local_base = iov[0].ctypes.data
    remote_base = iov[1].ctypes.data
    for s, e in _syscall_groups(n):
        want = int(n[s:e].sum())
        got, err = _readv(pid, local_base + 16 * s, remote_base + 16 * s, e - s)
        if got < 0:
            return err, os.strerror(err)
        if got != want:
            return -1, f"short read: {got} of {want} bytes"
    return 0, ""


def _copy_small(pid: int, dst: list[int], src: list[int], n: list[int]) -> tuple[int, str]:
    """``_copy`` for a few descriptors given as Python ints: coalesced and packed into one
    iovec pair without numpy, one syscall. Pieces too large for one syscall take ``_copy``."""
    d0, s0, n0 = [dst[0]], [src[0]], [n[0]]
    for d, s, ln in zip(dst[1:], src[1:], n[1:], strict=True):
        if d0[-1] + n0[-1] == d and s0[-1] + n0[-1] == s:  # contiguous on both sides
            n0[-1] += ln
        else:
            d0.append(d)
            s0.append(s)
            n0.append(ln)
    total = sum(n0)
    if total >= _GROUP_BYTES or max(n0) > _PIECE_BYTES or (
            pid == os.getpid() and not _self_copy_works()):
        u64 = np.uint64
        return _copy(pid, np.array(d0, dtype=u64), np.array(s0, dtype=u64),
                     np.array(n0, dtype=u64))
    k = len(n0)
    local = (ctypes.c_uint64 * (2 * k))()
    remote = (ctypes.c_uint64 * (2 * k))()
    local[0::2], local[1::2] = d0, n0
    remote[0::2], remote[1::2] = s0, n0
    got, err = _readv(pid, ctypes.addressof(local), ctypes.addressof(remote), k)
    if got < 0:
        return err, os.strerror(err)
    if got != total:
        return -1, f"short read: {got} of {total} bytes"
    return 0, ""


# --------------------------------------------------------------------------- registry wire


def _send_frame(sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with ``deadline`` (monotonic) all of them by then, so a peer sending a
    byte now and then cannot stretch one frame past it (``settimeout`` bounds each receive
    only)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"registry frame incomplete: {got} of {n} bytes in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the registry connection")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket, deadline: float | None = None,
                limit: int | None = None) -> Any:
    bound = _MAX_FRAME if limit is None else limit
    (length,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if length > bound:
        raise ValueError(f"registry frame of {length} bytes exceeds {bound}")
    return msgpack.unpackb(_recv_exact(sock, length, deadline), raw=False)


class _RegistryServer:
    """Answers ``describe`` queries on a TCP listener from one background thread.

    The thread blocks in ``select`` on the listener and a wake-up socket, so it costs nothing
    while idle and ``stop`` ends it at once; each client gets a bounded I/O timeout so a stuck
    client cannot hold the thread longer than that.
    """

    def __init__(self, host: str, port: int, describe: Any, io_timeout: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._describe = describe
        self._io_timeout = io_timeout
        self._thread = threading.Thread(
            target=self._run, name=f"rd2h-host-registry:{self.port}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        # A served connection stays open until its reader closes it (or a short deadline
        # passes), so the reader can check in /proc that this process holds the socket
        # that answered; the selector watches those connections without blocking others.
        lingering: dict[socket.socket, float] = {}
        try:
            while True:
                now = time.monotonic()
                for conn in [c for c, t in lingering.items() if t <= now]:
                    self._drop(conn, lingering)
                timeout = min(lingering.values(), default=now + _IDLE_SELECT_S) - now
                for key, _ in self._sel.select(max(timeout, 0.0)):
                    if key.data == "wake":
                        return
                    if key.data == "linger":
                        self._drop(key.fileobj, lingering)  # type: ignore[arg-type]
                        continue
                    try:
                        conn, _ = self._listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        return
                    if not self._serve(conn):
                        conn.close()
                        continue
                    if len(lingering) >= _MAX_LINGERING:
                        # Its reader has had the longest to verify: clients that connect
                        # and never close cannot keep every later reader from verifying.
                        self._drop(min(lingering, key=lingering.__getitem__), lingering)
                    lingering[conn] = time.monotonic() + self._io_timeout
                    self._sel.register(conn, selectors.EVENT_READ, "linger")
        finally:
            for conn in list(lingering):
                self._drop(conn, lingering)

    def _drop(self, conn: socket.socket, lingering: dict[socket.socket, float]) -> None:
        lingering.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> bool:
        """Answer one query; True when the answer went out (the reader may now verify)."""
        conn.settimeout(self._io_timeout)
        try:
            req = _recv_frame(conn, time.monotonic() + self._io_timeout, _MAX_REQUEST)
            if not _is_local_client(conn):
                reply = {"error": f"the host engine serves readers on this host only: "
                                  f"{ACROSS_HOSTS}"}
            elif isinstance(req, dict) and req.get("op") == "describe":
                reply = self._describe()
            else:
                reply = {"error": "unknown request; expected {'op': 'describe'}"}
            _send_frame(conn, reply)
            return True
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.debug("registry client dropped: %s", exc)
        except Exception:  # a bug here must not kill the registry for every other reader
            log.exception("registry failed to answer a client")
        return False

    def stop(self, timeout: float) -> bool:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        stopped = not self._thread.is_alive()
        if stopped:
            self._sel.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        return stopped


# --------------------------------------------------------------------------- engine state


@dataclass
class _Segment:
    """A /dev/shm file mapped into this process."""

    name: str
    base: int
    size: int
    mm: mmap.mmap
    array: np.ndarray


@dataclass
class _PeerView:
    """What a reader knows about one peer session, from one ``describe`` answer."""

    pid: int
    start: int | None
    same_pidns: bool
    gen: int
    ctl: np.ndarray  # read-only [generation, closed] mapped from the peer's control file
    ranges: RangeTable
    seg_bases: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    seg_ends: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    seg_local: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    maps: dict[tuple[str, int], Any] = field(default_factory=dict)
    # A pidfd of the peer, opened once its start time matched: it cannot follow a recycled
    # pid, and one poll says whether the process exited (reading /proc/PID/stat twice per
    # batch cost more than a 64 KiB copy). None where pidfds are unavailable.
    pidfd: int | None = None

    def problem(self) -> tuple[TransferResult, str] | None:
        """Why this view can no longer be trusted, or None."""
        if int(self.ctl[1]) != 0:
            return TransferResult.PEER_GONE, "peer closed its engine"
        if self.same_pidns and (_exited(self.pidfd) if self.pidfd is not None
                                else _proc_start_time(self.pid) != self.start):
            return TransferResult.PEER_GONE, f"peer process {self.pid} has exited"
        if int(self.ctl[0]) != self.gen:
            return TransferResult.PEER_RANGE, "peer unregistered memory since it was described"
        return None


def _map_readonly(name: str, min_size: int) -> tuple[mmap.mmap, np.ndarray]:
    if not _NAME_RE.match(name):
        raise ValueError(f"refusing shm name {name!r}")
    fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < min_size:
            raise ValueError(f"{name} holds {size} bytes, peer advertised {min_size}")
        mm = mmap.mmap(fd, min_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", p, exc)
    paths.clear()


class HostEngine(TransferEngine):
    """Moves bytes between processes on one host; ``mode`` is "auto", "cma" or "shm".

    "auto" picks CMA when ``cma_status()`` permits it and shm otherwise; the two forced modes
    exist so tests cover both paths. ``timeout`` bounds every registry round trip.
    """

    name = "host"

    def __init__(self, mode: str = "auto", timeout: float = REGISTRY_TIMEOUT_S) -> None:
        super().__init__()
        if mode not in ("auto", "cma", "shm"):
            raise EngineConfigError(f"host engine mode must be auto, cma or shm, not {mode!r}")
        permitted, why = cma_status()
        if mode == "cma" and not permitted:
            raise EngineUnavailable(f"host engine: CMA is not permitted here ({why})")
        self.mode = "cma" if mode == "cma" or (mode == "auto" and permitted) else "shm"
        self.mode_reason = why if self.mode == "cma" or mode == "auto" else "forced shm"
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._regions = RegionSet()
        self._segments: dict[int, _Segment] = {}
        self._peers: dict[str, _PeerView] = {}
        self._server: _RegistryServer | None = None
        self._session = ""
        self._host = ""
        self._closed = False
        self._gen = 0
        self._seq = 0
        self._token = secrets.token_hex(6)
        self._owned_files: list[str] = []
        # Files are removed even if the owner forgets close(); only SIGKILL can leak them.
        self._finalizer = weakref.finalize(self, _unlink_all, self._owned_files)
        self._ctl_name = self._shm_name("ctl")
        try:
            self._ctl_seg = self._create_shm(self._ctl_name, mmap.PAGESIZE)
        except OSError as exc:
            raise EngineUnavailable(f"host engine needs a writable {_SHM_DIR}: {exc}") from exc
        self._ctl = self._ctl_seg.array[:16].view(np.uint64)

    # -- identity -------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._session

    def _shm_name(self, suffix: str) -> str:
        return f"sfa_rd2h.{os.getpid()}.{self._token}.{suffix}"

    def _create_shm(self, name: str, size: int) -> _Segment:
        path = os.path.join(_SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._owned_files.append(path)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        return _Segment(name, int(arr.ctypes.data), size, mm, arr)

    # -- serving --------------------------------------------------------------------------

    def initialize(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._closed:
            raise EngineError("host engine is closed")
        if self._server is not None:
            if port in (0, self._server.port) and host == self._host:
                return self._session
            raise EngineConfigError(
                f"host engine already serves {self._session}; cannot also serve {host}:{port}"
            )
        if self.mode == "cma" and _ptrace_scope() == 1 and not _has_cap_sys_ptrace():
            # Yama scope 1 only lets ancestors read us and readers are siblings, so name the
            # one process whose descendants may read: by default our parent (the launcher of
            # the ranks), never "any process" unless the operator asks for it.
            _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(ptracer_pid()), 0, 0, 0)
        try:
            self._server = _RegistryServer(
                host, int(port), self._describe, io_timeout=min(self._timeout, REGISTRY_IO_S)
            )
        except OSError as exc:
            raise EngineConfigError(f"host engine cannot listen on {host}:{port}: {exc}") from exc
        shown = f"[{host}]" if ":" in host else host
        self._host = host
        self._session = f"{shown}:{self._server.port}"
        return self._session

    def _describe(self) -> dict[str, Any]:
        boot, pidns = _host_identity()
        with self._lock:
            addrs, lens = self._regions.snapshot()
            segs = [[s.name, s.base, s.size] for s in self._segments.values()]
            gen = self._gen
        return {
            "v": _WIRE_VERSION,
            "pid": os.getpid(),
            "start": _proc_start_time(os.getpid()),
            "boot": boot,
            "pidns": pidns,
            "gen": gen,
            "ctl": self._ctl_name,
            "addrs": addrs,
            "lens": lens,
            "shm": segs,
        }

    def _bump_generation(self) -> None:
        # Caller holds self._lock. Only withdrawals count: a reader's cached view stays a safe
        # subset when regions are added (a miss refreshes it), but not when one is removed.
        self._gen += 1
        self._ctl[0] = self._gen

    # -- memory ---------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, np.ndarray]:
        """A new /dev/shm-backed, registered region: ``(addr, uint8 array over it)``.

        Works in both modes; it is the only memory a shm-mode engine can serve.
        """
        if self._closed:
            raise EngineError("host engine is closed")
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise RegistrationError(f"cannot allocate {nbytes} bytes")
        with self._lock:
            self._seq += 1
            name = self._shm_name(str(self._seq))
        try:
            seg = self._create_shm(name, nbytes)
        except OSError as exc:
            raise RegistrationError(f"cannot allocate {nbytes} bytes in {_SHM_DIR}: {exc}") from exc
        with self._lock:
            self._segments[seg.base] = seg
        self.register_memory(seg.base, nbytes)
        return seg.base, seg.array

    def register_memory(self, addr: int, length: int) -> None:
        if self._closed:
            raise EngineError("host engine is closed")
        # In shm mode any memory may still be registered as a read *destination* (Decode's
        # CPU pool is vLLM's, not ours); peers can only read the allocate()d parts, and a
        # shm-mode reader says so when asked for anything else.
        addr, length = check_region(addr, length)
        with self._lock:
            self._regions.add(addr, length)

    def unregister_memory(self, addr: int) -> None:
        with self._lock:
            self._regions.remove(int(addr))
            self._bump_generation()

    # -- reading --------------------------------------------------------------------------

    def _fetch(self, session: str, host: str, port: int) -> _PeerView | tuple[TransferResult, str]:
        """Ask the peer's registry for its current registrations (one bounded round trip)."""
        try:
            deadline = time.monotonic() + self._timeout  # the whole round trip
            with socket.create_connection((host, port), timeout=self._timeout) as sock:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                _send_frame(sock, {"op": "describe", "v": _WIRE_VERSION})
                reply = _recv_frame(sock, deadline)
                # Verified while the connection is open: the registry keeps its end until
                # we close ours, so the socket it answered on is still in its fd table.
                refused = self._unproven(reply, _server_socket_inode(sock))
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            return TransferResult.PEER_UNREACHABLE, f"no registry answers at {session}: {exc}"
        if isinstance(reply, dict) and "v" not in reply and isinstance(reply.get("error"), str):
            # The registry's own refusal (e.g. a reader on another host): its words, kept
            # whole to the log and the failed read, never replaced by "not a reply".
            said = reply["error"][:300]
            said += "" if ACROSS_HOSTS in said else f" ({ACROSS_HOSTS})"
            log.warning("host engine refuses %s: %s", session, said)
            return TransferResult.PEER_UNREACHABLE, f"registry at {session} refused: {said}"
        try:
            if refused:
                log.warning("host engine refuses %s: %s", session, refused)
                return TransferResult.PEER_UNREACHABLE, f"registry at {session} refused: {refused}"
            return self._view_from(reply, session)
        except (KeyError, TypeError, ValueError, OverflowError, OSError) as exc:
            return TransferResult.PEER_UNREACHABLE, f"unusable registry reply from {session}: {exc}"

    def _unproven(self, reply: Any, server_inode: int | None) -> str | None:
        """Why a registry's answer cannot be believed, or None when it speaks for itself.

        A registry names the process whose memory will be read and the ranges it registered;
        believing any answer would let whoever answers at a session make this process copy
        any memory it can reach (another process's heap, or its own). So the answer must
        come from that very process: its registry socket is on this host and, where pids are
        shared, held by the pid it names; its shm segments carry that pid in their names.
        """
        if not isinstance(reply, dict) or "pid" not in reply:
            return None  # malformed answers are refused by _view_from, naming the problem
        if server_inode is None:
            return "its socket is not on this host"
        pid = reply["pid"]
        if type(pid) is not int or pid <= 0:
            return f"it names no valid pid ({pid!r})"
        ours = _host_identity()[1]
        if reply.get("pidns") == ours:
            if not _holds_socket(pid, server_inode):
                return f"pid {pid} does not hold the registry socket that answered"
        else:
            # Its pid cannot be checked from here, but whoever holds its socket and is
            # visible from here can: one in this namespace is not where it says it lives.
            liar = next((h for h in _socket_holders(server_inode) if _pidns_of(h) == ours),
                        None)
            if liar is not None:
                return (f"it says it is in another pid namespace, but pid {liar} of this one "
                        "holds the registry socket that answered")
        prefix = f"sfa_rd2h.{pid}."
        names = [str(reply.get("ctl", ""))] + [str(seg[0]) for seg in reply.get("shm") or ()
                                                if isinstance(seg, list | tuple) and seg]
        stray = [n for n in names if not n.startswith(prefix)]
        if stray:
            return f"segments {stray[:3]} are not pid {pid}'s"
        return None

    def _view_from(self, reply: Any, session: str) -> _PeerView | tuple[TransferResult, str]:
        if not isinstance(reply, dict) or reply.get("v") != _WIRE_VERSION:
            raise ValueError(f"not a version-{_WIRE_VERSION} registry reply")
        boot, pidns = _host_identity()
        if reply["boot"] != boot:
            return (TransferResult.PEER_UNREACHABLE,
                    f"{session} runs on another host: {ACROSS_HOSTS}")
        same_pidns = reply["pidns"] == pidns
        if self.mode == "cma" and not same_pidns:
            return (TransferResult.PEER_UNREACHABLE,
                    f"{session} is in another pid namespace; CMA cannot address it")
        _, ctl_arr = _map_readonly(str(reply["ctl"]), 16)
        addrs = [int(a) for a in reply["addrs"]]
        lens = [int(n) for n in reply["lens"]]
        if len(addrs) != len(lens):
            raise ValueError("ranges and lengths differ in count")
        view = _PeerView(
            pid=int(reply["pid"]),
            start=None if reply["start"] is None else int(reply["start"]),
            same_pidns=same_pidns,
            gen=int(reply["gen"]),
            ctl=ctl_arr[:16].view(np.uint64),
            ranges=RangeTable.build(addrs, lens),
        )
        if same_pidns:
            view.pidfd = _open_pidfd(view.pid, view.start)
            if view.pidfd is not None:
                weakref.finalize(view, os.close, view.pidfd)
        if self.mode == "shm":
            old = self._peers.get(session)
            segs = sorted((int(b), int(sz), str(nm)) for nm, b, sz in reply["shm"])
            local = []
            for _base, size, name in segs:
                key = (name, size)
                mapped = old.maps.get(key) if old is not None else None
                if mapped is None:
                    mapped = _map_readonly(name, size)
                view.maps[key] = mapped
                local.append(int(mapped[1].ctypes.data))
            view.seg_bases = np.array([s[0] for s in segs], dtype=np.uint64)
            view.seg_ends = view.seg_bases + np.array([s[1] for s in segs], dtype=np.uint64)
            view.seg_local = np.array(local, dtype=np.uint64)
        return view

    def _current_view(
        self, session: str, host: str, port: int, refresh: bool
    ) -> _PeerView | tuple[TransferResult, str]:
        with self._lock:
            view = None if refresh else self._peers.get(session)
        if view is not None:
            return view
        got = self._fetch(session, host, port)
        if isinstance(got, _PeerView):
            with self._lock:
                self._peers[session] = got
        return got

    def _forget(self, session: str) -> None:
        with self._lock:
            self._peers.pop(session, None)

    def batch_transfer_sync_read(
        self, session: str, local_addrs: Any, peer_addrs: Any, lengths: Any
    ) -> int:
        if self._closed:
            return self._fail(TransferResult.CLOSED, "host engine is closed")
        # Small batches (one layer's few coalesced runs) are checked as Python ints; the
        # checks are the same ones, in the same order, as for arrays.
        checked = self._preflight_any(session, local_addrs, peer_addrs, lengths, self._regions,
                                      small=True)
        if isinstance(checked, int):
            return checked
        local, peer, n = checked
        target = parse_session(session)
        if len(local) == 0:
            return int(TransferResult.OK)

        # Validate against the cached view; a miss or a moved generation earns one refresh.
        view: _PeerView | None = None
        for attempt in (0, 1):
            got = self._current_view(session, target[0], target[1], refresh=attempt == 1)
            if not isinstance(got, _PeerView):
                return self._fail(*got)
            trouble = got.problem()
            if trouble is not None and trouble[0] is TransferResult.PEER_GONE:
                self._forget(session)
                return self._fail(*trouble)
            if trouble is None:
                i = got.ranges.first_outside(peer, n)
                if i is None:
                    view = got
                    break
                trouble = (
                    TransferResult.PEER_RANGE,
                    f"descriptor {i}: source [0x{int(peer[i]):x}, +{int(n[i])}) is not inside "
                    f"memory {session} registered",
                )
            if attempt == 1:
                return self._fail(*trouble)
        assert view is not None

        if self.mode == "cma" and isinstance(local, list):
            pid = view.pid
            err, why = _copy(pid, local, peer, n)
        else:
            local, peer, n = (np.asarray(local, dtype=np.uint64), np.asarray(peer, dtype=np.uint64),
                              np.asarray(n, dtype=np.uint64))
            if self.mode == "cma":
                pid, src = view.pid, peer
            else:
                idx = np.searchsorted(view.seg_bases, peer, side="right").astype(np.intp) - 1
                safe = np.maximum(idx, 0)
                inside = ((idx >= 0) & (peer + n <= view.seg_ends[safe])
                          if view.seg_bases.size else np.zeros(peer.size, dtype=bool))
                if not inside.all():
                    i = int(np.flatnonzero(~inside)[0])
                    return self._fail(
                        TransferResult.PEER_RANGE,
                        f"descriptor {i}: source 0x{int(peer[i]):x} is not in a shm segment of "
                        f"{session} (shm mode reads only memory the peer allocate()d)",
                    )
                pid, src = os.getpid(), view.seg_local[safe] + (peer - view.seg_bases[safe])
            dst, src, n = coalesce(local, src, n)
            err, why = _copy(pid, dst, src, n)
        if err != 0:
            if err == errno.ESRCH:
                self._forget(session)
                return self._fail(TransferResult.PEER_GONE, f"peer process {pid} is gone")
            if err == errno.EPERM:
                return self._fail(
                    TransferResult.NOT_PERMITTED,
                    f"kernel refused process_vm_readv on pid {pid} ({cma_status()[1]})",
                )
            return self._fail(TransferResult.COPY_FAILED, why)
        # The peer may have exited or unregistered while we copied; then the bytes are suspect.
        trouble = view.problem()
        if trouble is not None:
            self._forget(session)
            return self._fail(trouble[0], f"during the copy: {trouble[1]}")
        return int(TransferResult.OK)

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctl[1] = 1  # readers holding a cached view see this before their next copy
        if self._server is not None:
            if not self._server.stop(timeout=self._timeout):
                log.warning("host engine registry thread did not stop within %.1fs",
                            self._timeout)
            self._server = None
        with self._lock:
            self._peers.clear()
        # Files go now; mappings stay valid until the last array over them is dropped.
        self._finalizer()
