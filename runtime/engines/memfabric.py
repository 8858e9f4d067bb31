"""The production engine: ``memfabric_hybrid.TransferEngine`` (memfabric-hybrid==1.3.0, Ascend).

The library's Python surface, as its 1.3.0 wheel declares it::

    TransferEngine()
    .initialize(store_url, session_id, role, device_id,
                data_op_type=TransDataOpType.SDMA, store_server_role="Decode", nic="") -> int
    .get_rpc_port() -> int
    .register_memory(buffer_addr, capacity) -> int
    .unregister_memory(buffer_addr) -> int
    .batch_transfer_sync_read(dest_session, buffers, peer_buffers, lengths, flags=0) -> int
    .destroy() / .unInitialize()
    module: create_config_store(store_url), get_last_err_msg(), TransDataOpType

``role`` is exactly "Prefill" or "Decode"; ``session_id`` is the "ip:port" peers pass as
``dest_session``; the process whose role equals ``store_server_role`` serves the config store
at ``store_url`` and the others connect to it. Every call answers 0 or an error code.

This module adds what the protocol needs on top (PROTOCOL F2, F4, L1):

* one engine per process, bound to one role, device and hostname; a second, different
  configuration raises ``EngineConfigError`` naming both (F4). Handles with the same
  configuration share it; the last ``close`` releases it.
* each region is registered once: the same address and length again is a no-op, an overlap
  with a different region is an error.
* any non-zero result or exception from the library becomes a non-zero return (F2), and local
  destinations are checked against our registrations before the library is called (L1).

On CPU machines ``memfabric_hybrid`` is absent or finds no Ascend driver; the constructor then
raises ``EngineUnavailable``. Tests inject ``fake_memfabric`` through ``backend_module=``.
"""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sfa_rd2h.runtime import ports
from sfa_rd2h.runtime.engines.base import (
    EngineConfigError,
    EngineError,
    EngineUnavailable,
    RegionSet,
    RegistrationError,
    TransferEngine,
    TransferResult,
)

_ROLES = {"prefill": "Prefill", "decode": "Decode"}
STORE_URL_ENV = "ASCEND_MF_STORE_URL"


def _canonical_role(role: str) -> str:
    try:
        return _ROLES[str(role).lower()]
    except KeyError:
        raise EngineConfigError(
            f"MemFabric role must be 'Prefill' or 'Decode', not {role!r}"
        ) from None


def npu_visible() -> bool:
    """Whether an Ascend device node exists; memfabric's data paths need the NPU driver."""
    return bool(glob.glob("/dev/davinci[0-9]*"))


def load_memfabric() -> ModuleType:
    """Import ``memfabric_hybrid`` or say precisely why it cannot run here."""
    try:
        import memfabric_hybrid  # type: ignore[import-not-found]
    except (ImportError, OSError) as exc:
        raise EngineUnavailable(
            "memfabric engine unavailable: memfabric_hybrid cannot be imported "
            f"(install memfabric-hybrid==1.3.0 via the 'npu' extra on an Ascend host): {exc}"
        ) from exc
    if not npu_visible():
        raise EngineUnavailable(
            "memfabric engine unavailable: memfabric_hybrid is installed but no Ascend NPU "
            "is visible (no /dev/davinci* device); use the 'host' engine on this machine"
        )
    return memfabric_hybrid


@dataclass(frozen=True)
class _Config:
    role: str
    device_id: int
    hostname: str
    backend: str

    def __str__(self) -> str:
        return (
            f"role={self.role} device={self.device_id} hostname={self.hostname} "
            f"backend={self.backend}"
        )


@dataclass
class _Binding:
    """The process-wide library engine and what has been registered with it."""

    config: _Config
    engine: Any
    module: ModuleType
    session: str
    port: int
    regions: RegionSet
    users: int


_BINDING: _Binding | None = None
_BINDING_LOCK = threading.Lock()


def _last_error(module: ModuleType) -> str:
    getter = getattr(module, "get_last_err_msg", None)
    if getter is None:
        return ""
    try:
        return str(getter())
    except Exception:  # diagnostics only; the failure being reported matters more
        return ""


class MemFabricEngine(TransferEngine):
    """A handle on the process-wide MemFabric engine (F4)."""

    name = "memfabric"

    def __init__(
        self,
        role: str,
        device_id: int = 0,
        store_url: str | None = None,
        data_op_type: str = "SDMA",
        store_server_role: str = "Decode",
        nic: str = "",
        backend_module: ModuleType | None = None,
    ) -> None:
        super().__init__()
        self.role = _canonical_role(role)
        self.store_server_role = _canonical_role(store_server_role)
        self.device_id = int(device_id)
        if self.device_id < 0:
            raise EngineConfigError(f"MemFabric device id must be >= 0, not {device_id}")
        self._module = backend_module if backend_module is not None else load_memfabric()
        op_types = getattr(self._module.TransDataOpType, "__members__", {})
        if data_op_type not in op_types:
            raise EngineConfigError(
                f"MemFabric data_op_type {data_op_type!r} is not one of {sorted(op_types)}"
            )
        self._op_type = op_types[data_op_type]
        self._store_url = store_url
        self._nic = nic
        self._binding: _Binding | None = None

    @property
    def session_id(self) -> str:
        return self._binding.session if self._binding is not None else ""

    def initialize(self, host: str = "127.0.0.1", port: int = 0) -> str:
        global _BINDING
        config = _Config(self.role, self.device_id, host, self._module.__name__)
        with _BINDING_LOCK:
            bound = _BINDING
            if bound is not None:
                if bound.config != config:
                    raise EngineConfigError(
                        f"F4: the process-wide MemFabric engine is bound to [{bound.config}]; "
                        f"it cannot be re-configured as [{config}]"
                    )
                if port and int(port) != bound.port:
                    raise EngineConfigError(
                        f"F4: the process-wide MemFabric engine serves {bound.session}; "
                        f"it cannot also serve port {port}"
                    )
                if self._binding is not bound:
                    bound.users += 1
                    self._binding = bound
                return bound.session
            store_url = self._store_url or os.environ.get(STORE_URL_ENV, "")
            if not store_url:
                raise EngineConfigError(
                    f"MemFabric needs its config-store URL: pass store_url= or set "
                    f"{STORE_URL_ENV} (e.g. tcp://10.0.0.1:6650)"
                )
            port = int(port) or ports.free_port(host)
            session = f"{host}:{port}"
            engine = self._module.TransferEngine()
            try:
                ret = engine.initialize(
                    store_url, session, self.role, self.device_id, self._op_type,
                    self.store_server_role, self._nic,
                )
            except Exception as exc:
                raise EngineUnavailable(
                    f"MemFabric initialize raised for [{config}] store={store_url}: {exc}"
                ) from exc
            if ret != 0:
                raise EngineUnavailable(
                    f"MemFabric initialize returned {ret} for [{config}] session={session} "
                    f"store={store_url}: {_last_error(self._module) or 'no detail'}"
                )
            _BINDING = _Binding(config, engine, self._module, session, port, RegionSet(), 1)
            self._binding = _BINDING
            return session

    def _bound(self) -> _Binding:
        if self._binding is None:
            raise EngineError("MemFabric engine is not initialised (or already closed)")
        return self._binding

    def register_memory(self, addr: int, length: int) -> None:
        # The regions belong to the process-wide binding: another handle's registration counts.
        b = self._bound()
        self._register_region(b.regions, b.engine.register_memory, addr, length, "MemFabric",
                              lambda: _last_error(b.module) or "no detail")

    def unregister_memory(self, addr: int) -> None:
        b = self._bound()
        b.regions.remove(int(addr))
        try:
            ret = b.engine.unregister_memory(int(addr))
        except Exception as exc:
            raise RegistrationError(f"MemFabric unregister_memory raised: {exc}") from exc
        if ret != 0:
            raise RegistrationError(
                f"MemFabric unregister_memory(0x{int(addr):x}) returned {ret}: "
                f"{_last_error(b.module) or 'no detail'}"
            )

    def batch_transfer_sync_read(
        self, session: str, local_addrs: Any, peer_addrs: Any, lengths: Any
    ) -> int:
        b = self._binding
        if b is None:
            return self._fail(TransferResult.CLOSED, "MemFabric engine is not initialised")
        checked = self._preflight(session, local_addrs, peer_addrs, lengths, b.regions)
        if isinstance(checked, int):
            return checked
        return self._library_read(b.engine.batch_transfer_sync_read, session, *checked,
                                  "MemFabric", lambda: _last_error(b.module) or "no detail")

    def close(self) -> None:
        global _BINDING
        with _BINDING_LOCK:
            b, self._binding = self._binding, None
            if b is None:
                return
            b.users -= 1
            if b.users > 0:
                return
            if _BINDING is b:
                _BINDING = None
        for step in ("destroy", "unInitialize"):
            try:
                getattr(b.engine, step)()
            except Exception:  # tearing down: a failed step must not hide the next one
                pass


def bound_config() -> str | None:
    """The configuration the process-wide engine is bound to, for diagnostics."""
    b = _BINDING
    return str(b.config) if b is not None else None
