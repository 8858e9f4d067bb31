"""A stand-in for the ``memfabric_hybrid`` module, for machines without an Ascend NPU.

It exposes the slice of memfabric-hybrid 1.3.0's surface the MemFabric engine uses, with the
library's documented semantics: ``initialize(store_url, session_id, role, device_id, ...)``
checks its arguments the way the library does (role exactly "Prefill"/"Decode", store URL
``tcp://ip:port``, session ``ip:port`` with a numeric IPv4) and every call answers 0 or an
error code instead of raising. Failed reads answer *positive* codes, as the real library may,
so callers that only test ``ret < 0`` are caught out.

Bytes really move: each fake engine is a host engine serving at exactly ``session_id``, so two
processes exchange data as two MemFabric endpoints would. The config store is not modelled:
peers reach each other at their session address directly, and the store URL is only
validated. Reaching this module takes ``MemFabricEngine(backend_module=fake_memfabric)``;
no production configuration selects it.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Sequence

from sfa_rd2h.runtime.engines.base import EngineError
from sfa_rd2h.runtime.engines.host import HostEngine

__all__ = [
    "TransDataOpType",
    "TransferEngine",
    "TransferOpcode",
    "create_config_store",
    "get_last_err_msg",
    "set_log_level",
]

_URL_RE = re.compile(r"^tcp://([0-9.]+):([0-9]{1,5})$")
_last_error = ""


class TransDataOpType(enum.Enum):
    SDMA = 1
    HOST_RDMA = 2
    DEVICE_RDMA = 3
    DEVICE_URMA = 4
    DEVICE_UBOE = 5


class TransferOpcode(enum.Enum):
    Read = 0
    Write = 1


def _error(msg: str, code: int = 1) -> int:
    global _last_error
    _last_error = msg
    return code


def get_last_err_msg() -> str:
    return _last_error


def set_log_level(level: int) -> int:
    return 0 if level in (0, 1, 2, 3) else _error(f"invalid log level {level}")


def _ipv4_port(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return None
    return host, int(port)


def create_config_store(store_url: str) -> int:
    m = _URL_RE.match(store_url or "")
    if m is None or _ipv4_port(f"{m.group(1)}:{m.group(2)}") is None:
        return _error(f"invalid store url {store_url!r}; expected tcp://ip:port")
    return 0


class TransferEngine:
    """Same methods and return conventions as ``memfabric_hybrid.TransferEngine``."""

    TransDataOpType = TransDataOpType

    def __init__(self) -> None:
        self._host: HostEngine | None = None
        self._port = 0

    def initialize(
        self,
        store_url: str,
        session_id: str,
        role: str,
        device_id: int,
        data_op_type: TransDataOpType = TransDataOpType.SDMA,
        store_server_role: str = "Decode",
        nic: str = "",
    ) -> int:
        if self._host is not None:
            return _error("transfer engine is already initialized")
        if role not in ("Prefill", "Decode") or store_server_role not in ("Prefill", "Decode"):
            return _error("The value of role is invalid. Expected 'Prefill' or 'Decode'.")
        if create_config_store(store_url) != 0:
            return 1
        target = _ipv4_port(session_id)
        if target is None:
            return _error(f"invalid session id {session_id!r}; expected numeric ipv4:port")
        if not isinstance(device_id, int) or device_id < 0:
            return _error(f"invalid device id {device_id!r}")
        if not isinstance(data_op_type, TransDataOpType):
            return _error(f"invalid data op type {data_op_type!r}")
        host = HostEngine()
        try:
            host.initialize(*target)
        except EngineError as exc:
            host.close()
            return _error(str(exc))
        self._host, self._port = host, target[1]
        return 0

    def get_rpc_port(self) -> int:
        return self._port

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        if self._host is None:
            return _error("register_memory before initialize")
        try:
            self._host.register_memory(buffer_addr, capacity)
        except EngineError as exc:
            return _error(str(exc))
        return 0

    def batch_register_memory(self, buffer_addrs: Sequence[int], capacities: Sequence[int]) -> int:
        if len(buffer_addrs) != len(capacities):
            return _error("buffer_addrs and capacities differ in length")
        for addr, cap in zip(buffer_addrs, capacities, strict=True):
            ret = self.register_memory(addr, cap)
            if ret != 0:
                return ret
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        if self._host is None:
            return _error("unregister_memory before initialize")
        try:
            self._host.unregister_memory(buffer_addr)
        except EngineError as exc:
            return _error(str(exc))
        return 0

    def batch_transfer_sync_read(
        self,
        dest_session: str,
        buffers: Sequence[int],
        peer_buffers: Sequence[int],
        lengths: Sequence[int],
        flags: int = 0,
    ) -> int:
        if self._host is None:
            return _error("batch_transfer_sync_read before initialize")
        ret = self._host.batch_transfer_sync_read(dest_session, buffers, peer_buffers, lengths)
        return 0 if ret == 0 else _error(self._host.last_error, code=-ret)

    def transfer_sync_read(
        self, dest_session: str, buffer: int, peer_buffer: int, length: int, flags: int = 0
    ) -> int:
        return self.batch_transfer_sync_read(dest_session, [buffer], [peer_buffer], [length])

    def batch_transfer_sync_write(
        self,
        dest_session: str,
        buffers: Sequence[int],
        peer_buffers: Sequence[int],
        lengths: Sequence[int],
        flags: int = 0,
    ) -> int:
        # RD2H only ever pulls; a write path here would be untested surface.
        return _error("the fake MemFabric engine supports reads only")

    def destroy(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None

    def unInitialize(self) -> None:  # noqa: N802 - the library's spelling
        self.destroy()
