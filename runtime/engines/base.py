"""The transfer-engine interface (PROTOCOL X1) and the pieces every engine shares.

The call shape is MemFabric's: ``initialize`` returns a ``host:port`` session id that peers use
to reach this engine, memory is registered by address, and Decode pulls with one synchronous
batched read ``batch_transfer_sync_read(session, local_addrs, peer_addrs, lengths) -> int``.

Two rules hold for every engine, because the protocol cores depend on them:

* A data-path failure is a return value, never an exception (F2: any non-zero result becomes
  READ_FAILED). Bad session, unregistered or out-of-bounds ranges, a dead peer, malformed
  descriptor arrays: all of them return a non-zero ``TransferResult``.
* Every descriptor is checked before the first byte moves, so a batch that fails validation
  leaves the destination untouched (L1, R5). Engines that wrap a third-party library check
  what they can see (their own registrations) and document the rest.

Configuration mistakes (unknown engine, F4 re-configuration, overlapping registration) are
programming errors and raise ``EngineError`` subclasses of ``ProtocolError``.
"""

from __future__ import annotations

import abc
import bisect
import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sfa_rd2h.spec.errors import ProtocolError

if TYPE_CHECKING:
    import torch

_U64_MAX = (1 << 64) - 1

class EngineError(ProtocolError):
    """A transfer engine was configured or used in a way it cannot serve."""


class EngineUnavailable(EngineError):
    """The requested engine does not exist or cannot run on this machine."""


class EngineConfigError(EngineError):
    """An engine was configured inconsistently (e.g. F4: a second, different binding)."""


class RegistrationError(EngineError):
    """A memory region cannot be registered or unregistered as asked."""


class TransferResult(enum.IntEnum):
    """Why a batched read failed. Only ``OK`` is zero; callers treat any non-zero alike (F2)."""

    OK = 0
    BAD_DESCRIPTORS = -1  # arrays of different length, negative or overflowing values
    BAD_SESSION = -2  # not a "host:port" string
    LOCAL_RANGE = -3  # destination not inside memory registered with this engine
    PEER_RANGE = -4  # source not inside memory the peer registered
    PEER_UNREACHABLE = -5  # nobody answers at the session, or it is on another host
    PEER_GONE = -6  # the peer answered once and has since exited or closed its engine
    COPY_FAILED = -7  # the copy itself failed or was short
    NOT_PERMITTED = -8  # the kernel refused cross-process access
    CLOSED = -9  # this engine was closed or never initialised
    BACKEND = -10  # a wrapped library returned non-zero or raised


class BatchError(ValueError):
    """Descriptor arrays that cannot describe a read; engines turn it into BAD_DESCRIPTORS."""


def as_u64(values: Any, what: str) -> np.ndarray:
    """One descriptor column as a 1-D uint64 array, rejecting negatives and non-integers."""
    if isinstance(values, np.ndarray):
        arr = values.ravel()
        if arr.dtype == np.uint64:
            return arr
        if arr.dtype.kind == "u":
            return arr.astype(np.uint64)
        if arr.dtype.kind != "i":
            raise BatchError(f"{what}: integer array expected, got dtype {arr.dtype}")
        if arr.size and int(arr.min()) < 0:
            raise BatchError(f"{what}: negative value")
        return arr.astype(np.uint64)
    try:
        seq = list(values)
    except TypeError as exc:
        raise BatchError(f"{what}: a sequence of integers expected") from exc
    if not seq:
        return np.zeros(0, dtype=np.uint64)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in seq):
        raise BatchError(f"{what}: integers expected")
    if min(seq) < 0 or max(seq) > _U64_MAX:
        raise BatchError(f"{what}: value outside 0..2**64-1")
    return np.array(seq, dtype=np.uint64)


def descriptor_arrays(
    local_addrs: Any, peer_addrs: Any, lengths: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and normalise a batch; zero-length descriptors are dropped (they move nothing).

    Raises ``BatchError`` for arrays that cannot describe a read: unequal lengths, negative
    values, or a range that wraps past the end of the address space.
    """
    local = as_u64(local_addrs, "local_addrs")
    peer = as_u64(peer_addrs, "peer_addrs")
    n = as_u64(lengths, "lengths")
    if not (local.size == peer.size == n.size):
        raise BatchError(
            f"descriptor arrays differ in length: local={local.size} peer={peer.size} "
            f"lengths={n.size}"
        )
    keep = n > 0
    if not keep.all():
        local, peer, n = local[keep], peer[keep], n[keep]
    # uint64 addition wraps silently: a wrapped end is smaller than its start.
    with np.errstate(over="ignore"):
        if np.any(local + n < local) or np.any(peer + n < peer):
            raise BatchError("a descriptor runs past the end of the address space")
    return local, peer, n


# Batches up to this many descriptors are checked and copied as Python ints: at one to a few
# descriptors (a 2 MiB layer read), the ~40 small numpy calls of the array path cost more
# than the copy; beyond it the array path's per-call cost is amortised.
SMALL_BATCH = 16


def _small_column(values: Any, what: str) -> list[int] | None:
    """One descriptor column as at most SMALL_BATCH Python ints, or None when it is longer;
    refuses exactly what ``as_u64`` refuses, with the same messages."""
    if isinstance(values, np.ndarray):
        if values.size > SMALL_BATCH:
            return None
        kind = values.dtype.kind
        if kind not in "ui":
            raise BatchError(f"{what}: integer array expected, got dtype {values.dtype}")
        out = values.ravel().tolist()
        if kind == "i" and out and min(out) < 0:
            raise BatchError(f"{what}: negative value")
        return out
    try:
        seq = list(values)
    except TypeError as exc:
        raise BatchError(f"{what}: a sequence of integers expected") from exc
    if len(seq) > SMALL_BATCH:
        return None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in seq):
        raise BatchError(f"{what}: integers expected")
    out = [int(v) for v in seq]
    if out and (min(out) < 0 or max(out) > _U64_MAX):
        raise BatchError(f"{what}: value outside 0..2**64-1")
    return out


def descriptor_lists(
    local_addrs: Any, peer_addrs: Any, lengths: Any
) -> tuple[list[int], list[int], list[int]] | None:
    """``descriptor_arrays`` for a batch of at most SMALL_BATCH descriptors, as lists of
    Python ints; None when a column is longer (use ``descriptor_arrays``). The same checks,
    the same ``BatchError`` messages, zero-length descriptors dropped likewise."""
    local = _small_column(local_addrs, "local_addrs")
    if local is None:
        return None
    peer = _small_column(peer_addrs, "peer_addrs")
    n = _small_column(lengths, "lengths")
    if peer is None or n is None:
        return None
    if not (len(local) == len(peer) == len(n)):
        raise BatchError(
            f"descriptor arrays differ in length: local={len(local)} peer={len(peer)} "
            f"lengths={len(n)}"
        )
    if 0 in n:
        keep = [i for i, ln in enumerate(n) if ln > 0]
        local, peer, n = [local[i] for i in keep], [peer[i] for i in keep], [n[i] for i in keep]
    # Python ints do not wrap; an end at or past 2**64 is one the array path sees wrap.
    for a, b, ln in zip(local, peer, n, strict=True):
        if a + ln > _U64_MAX or b + ln > _U64_MAX:
            raise BatchError("a descriptor runs past the end of the address space")
    return local, peer, n


def coalesce(
    local: np.ndarray, peer: np.ndarray, n: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors that are contiguous on both sides into one.

    KV blocks of one request are often adjacent in both caches; merging them turns thousands
    of block copies into a handful of large ones without changing which bytes move.
    """
    if local.size < 2:
        return local, peer, n
    joins = (local[:-1] + n[:-1] == local[1:]) & (peer[:-1] + n[:-1] == peer[1:])
    if not joins.any():
        return local, peer, n
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    sums = np.add.reduceat(n, starts)
    return local[starts], peer[starts], sums.astype(np.uint64)


@dataclass(frozen=True)
class RangeTable:
    """A sorted, immutable set of non-overlapping ``[start, end)`` ranges, looked up with numpy."""

    starts: np.ndarray
    ends: np.ndarray
    # The same ranges as Python ints, for small batches (built once: tables change only when
    # a region is registered or withdrawn, reads are hot).
    start_list: list[int] = field(init=False, repr=False, compare=False)
    end_list: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_list", self.starts.tolist())
        object.__setattr__(self, "end_list", self.ends.tolist())

    @classmethod
    def build(cls, addrs: Sequence[int], lengths: Sequence[int]) -> RangeTable:
        s = np.asarray(addrs, dtype=np.uint64).ravel()
        e = s + np.asarray(lengths, dtype=np.uint64).ravel()
        order = np.argsort(s, kind="stable")
        return cls(s[order], e[order])

    def __len__(self) -> int:
        return int(self.starts.size)

    def locate(self, addrs: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each ``[addr, addr+n)``: whether one range holds all of it, and which one.

        Returns ``(ok, idx)``; ``idx`` is only meaningful where ``ok`` is true.
        """
        if self.starts.size == 0 or addrs.size == 0:
            return np.zeros(addrs.size, dtype=bool), np.zeros(addrs.size, dtype=np.intp)
        idx = np.searchsorted(self.starts, addrs, side="right").astype(np.intp) - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (addrs + n <= self.ends[safe])
        return ok, safe

    def first_outside(self, addrs: np.ndarray | list[int], n: np.ndarray | list[int]) -> int | None:
        """The index of the first ``[addr, addr+n)`` no single range holds, or None."""
        if isinstance(addrs, list):
            starts, ends = self.start_list, self.end_list
            for i, (a, ln) in enumerate(zip(addrs, n, strict=True)):
                j = bisect.bisect_right(starts, a) - 1
                if j < 0 or a + ln > ends[j]:
                    return i
            return None
        ok, _ = self.locate(addrs, np.asarray(n))
        return None if ok.all() else int(np.flatnonzero(~ok)[0])


class RegionSet:
    """This process's registered regions: idempotent on an identical region, strict on overlap.

    Registration is rare (start-up), reads are hot, so the sorted snapshot used by reads is
    rebuilt only when the set changes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._lens: list[int] = []
        self._table = RangeTable.build([], [])

    def add(self, addr: int, length: int) -> bool:
        """Record ``[addr, addr+length)``; False if exactly that region is already present."""
        addr, length = check_region(addr, length)
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i < len(self._starts) and self._starts[i] == addr:
                if self._lens[i] == length:
                    return False
                raise RegistrationError(
                    f"region 0x{addr:x} is already registered with {self._lens[i]} bytes, "
                    f"not {length}; unregister it first"
                )
            for j in (i - 1, i):
                if 0 <= j < len(self._starts):
                    s, ln = self._starts[j], self._lens[j]
                    if s < addr + length and addr < s + ln:
                        raise RegistrationError(
                            f"region [0x{addr:x}, +{length}) overlaps the registered region "
                            f"[0x{s:x}, +{ln})"
                        )
            self._starts.insert(i, addr)
            self._lens.insert(i, length)
            self._table = RangeTable.build(self._starts, self._lens)
            return True

    def remove(self, addr: int) -> int:
        """Forget the region starting at ``addr``; returns its length."""
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i == len(self._starts) or self._starts[i] != addr:
                raise RegistrationError(f"no region is registered at 0x{addr:x}")
            length = self._lens.pop(i)
            self._starts.pop(i)
            self._table = RangeTable.build(self._starts, self._lens)
            return length

    def table(self) -> RangeTable:
        return self._table

    def snapshot(self) -> tuple[list[int], list[int]]:
        with self._lock:
            return list(self._starts), list(self._lens)

    def __len__(self) -> int:
        return len(self._starts)


def check_region(addr: int, length: int) -> tuple[int, int]:
    """A region as two Python ints, or ``RegistrationError`` if it cannot be one."""
    try:
        a, n = int(addr), int(length)
    except (TypeError, ValueError) as exc:
        raise RegistrationError(f"region address and length must be integers: {exc}") from exc
    if a <= 0 or n <= 0 or a + n > _U64_MAX:
        raise RegistrationError(f"invalid region: addr={a:#x} length={n}")
    return a, n


def parse_session(session: Any) -> tuple[str, int] | None:
    """``"host:port"`` as ``(host, port)``, or None when it is not one."""
    if not isinstance(session, str):
        return None
    host, sep, port_s = session.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit():
        return None
    port = int(port_s)
    if not 0 < port < 65536:
        return None
    return host, port


class TransferEngine(abc.ABC):
    """One endpoint of the KV transport: registers memory, serves it, and pulls from peers."""

    #: Short name used by ``make_engine`` and in reports.
    name: str = "abstract"

    @property
    def last_error(self) -> str:
        """Human-readable reason of the latest non-zero result of this thread's calls, for
        logs and reports. Per thread: Decode reads on several lanes of one engine at once,
        and each failure must be reported with its own reason."""
        return getattr(self._errors(), "text", "")

    @last_error.setter
    def last_error(self, text: str) -> None:
        self._errors().text = text

    def _errors(self) -> threading.local:
        return self.__dict__.setdefault("_last_errors", threading.local())

    @abc.abstractmethod
    def initialize(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving on ``host:port`` (0 = any free port); returns the session id."""

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """The ``host:port`` peers pass to ``batch_transfer_sync_read`` to reach this engine."""

    @abc.abstractmethod
    def register_memory(self, addr: int, length: int) -> None:
        """Make ``[addr, addr+length)`` readable by peers and usable as a read destination."""

    @abc.abstractmethod
    def unregister_memory(self, addr: int) -> None:
        """Withdraw the region registered at ``addr``."""

    @abc.abstractmethod
    def batch_transfer_sync_read(
        self, session: str, local_addrs: Any, peer_addrs: Any, lengths: Any
    ) -> int:
        """Copy ``peer[i] .. peer[i]+lengths[i]`` of ``session`` to ``local[i]``, for every i.

        Returns 0 when every byte landed, a non-zero ``TransferResult`` otherwise. Never raises
        for a data-path failure; a batch that fails validation leaves the destination untouched.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and release resources; idempotent."""

    def _fail(self, code: TransferResult, reason: str) -> int:
        self.last_error = f"{code.name}: {reason}"
        return int(code)

    def _preflight(
        self, session: Any, local_addrs: Any, peer_addrs: Any, lengths: Any, regions: RegionSet
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | int:
        """The checks every engine makes before a batch: well-formed descriptors, a
        ``host:port`` session, destinations inside locally registered memory. Returns the
        descriptor arrays, or the failure code (already recorded in ``last_error``)."""
        got = self._preflight_any(session, local_addrs, peer_addrs, lengths, regions, False)
        return got  # type: ignore[return-value]  # small=False always yields arrays

    def _preflight_any(
        self, session: Any, local_addrs: Any, peer_addrs: Any, lengths: Any, regions: RegionSet,
        small: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | tuple[list[int], list[int], list[int]] | int:
        """``_preflight``; with ``small``, a batch of at most SMALL_BATCH descriptors comes
        back as lists of Python ints (the same checks, made without numpy)."""
        try:
            lists = descriptor_lists(local_addrs, peer_addrs, lengths) if small else None
            local, peer, n = (lists if lists is not None
                              else descriptor_arrays(local_addrs, peer_addrs, lengths))
        except BatchError as exc:
            return self._fail(TransferResult.BAD_DESCRIPTORS, str(exc))
        if parse_session(session) is None:
            return self._fail(TransferResult.BAD_SESSION, f"{session!r} is not host:port")
        if len(local):
            i = regions.table().first_outside(local, n)
            if i is not None:
                return self._fail(
                    TransferResult.LOCAL_RANGE,
                    f"descriptor {i}: destination [0x{int(local[i]):x}, +{int(n[i])}) is not "
                    f"inside memory registered with the {self.name} engine",
                )
        return local, peer, n

    def _register_region(self, regions: RegionSet, register: Any, addr: int, length: int,
                         label: str, detail: Any = None) -> None:
        """Register a region once with a third-party engine, keeping ``regions`` (the
        ranges reads are checked against) in step with what the library accepted."""
        addr, length = check_region(addr, length)
        if not regions.add(addr, length):
            return  # registered before: once is enough
        try:
            ret = register(addr, length)
            why = detail() if detail is not None and ret != 0 else ""
        except Exception as exc:
            ret, why = -1, str(exc)
        if ret != 0:
            regions.remove(addr)
            raise RegistrationError(f"{label} register_memory(0x{addr:x}, {length}) returned "
                                    f"{ret}" + (f": {why}" if why else ""))

    def _library_read(self, read: Any, session: str, local: np.ndarray, peer: np.ndarray,
                      n: np.ndarray, label: str, detail: Any = None) -> int:
        """Hand a checked batch to a third-party engine's ``batch_transfer_sync_read``:
        coalesced, as Python ints, with exceptions and non-zero results made failures (F2)."""
        if local.size == 0:
            return int(TransferResult.OK)
        local, peer, n = coalesce(local, peer, n)
        try:
            ret = read(session, local.tolist(), peer.tolist(), n.tolist())
        except Exception as exc:
            return self._fail(TransferResult.BACKEND, f"{label} read raised: {exc}")
        if ret != 0:
            why = detail() if detail is not None else ""
            return self._fail(TransferResult.BACKEND,
                              f"{label} batch_transfer_sync_read returned {ret}"
                              + (f": {why}" if why else ""))
        return int(TransferResult.OK)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensor_region(t: torch.Tensor) -> tuple[int, int]:
    """``(data_ptr, nbytes)`` of a tensor's storage window, for ``register_memory``.

    Only contiguous tensors describe one byte range; a strided view would silently register
    bytes that are not the tensor's.
    """
    import torch  # lazy: torch is heavy and only needed when tensors are involved

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torch.Tensor expected, got {type(t).__name__}")
    if not t.is_contiguous():
        raise RegistrationError("only a contiguous tensor is one registrable byte range")
    return int(t.data_ptr()), int(t.numel() * t.element_size())
