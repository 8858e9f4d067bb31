"""Optional engine over Mooncake's ``mooncake.engine.TransferEngine`` (TCP transport).

Mooncake is a widely used third-party engine with the same call shape as MemFabric, which
makes it a useful cross-check that the interface is not shaped around one library. Install:
Debian ``libibverbs1`` (the wheel links it even for TCP) and PyPI
``mooncake-transfer-engine-non-cuda``. Its Python surface::

    TransferEngine()
    .initialize(local_hostname, metadata_server, protocol, device_name) -> int
    .get_rpc_port() -> int            # with P2PHANDSHAKE the session is host:rpc_port
    .register_memory(addr, capacity) -> int / .unregister_memory(addr) -> int
    .batch_transfer_sync_read(target_hostname, buffers, peer_buffer_addresses, lengths) -> int

The wrapper adds what the interface promises: local destinations are checked against our
registrations before the library runs, registration is idempotent, and any non-zero result or
exception becomes a non-zero return. Mooncake checks the source ranges on the peer's side;
when one descriptor of a batch is out of bounds there, descriptors before it may already have
landed, so only locally detectable faults are guaranteed to leave the destination untouched.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from sfa_rd2h.runtime.engines.base import (
    EngineError,
    EngineUnavailable,
    RegionSet,
    RegistrationError,
    TransferEngine,
    TransferResult,
)


def load_mooncake() -> ModuleType:
    """Import ``mooncake.engine`` or say precisely why it cannot run here."""
    try:
        from mooncake import engine  # type: ignore[import-not-found]
    except (ImportError, OSError) as exc:
        raise EngineUnavailable(
            "mooncake engine unavailable: install Debian libibverbs1 and "
            f"'pip install mooncake-transfer-engine-non-cuda': {exc}"
        ) from exc
    return engine


class MooncakeEngine(TransferEngine):
    """``protocol`` is Mooncake's transport name; "tcp" works on any host."""

    name = "mooncake"

    def __init__(
        self,
        protocol: str = "tcp",
        metadata_server: str = "P2PHANDSHAKE",
        device_name: str = "",
        backend_module: ModuleType | None = None,
    ) -> None:
        super().__init__()
        self._module = backend_module if backend_module is not None else load_mooncake()
        self._protocol = protocol
        self._metadata_server = metadata_server
        self._device_name = device_name
        self._engine: Any = None
        self._session = ""
        self._regions = RegionSet()

    @property
    def session_id(self) -> str:
        return self._session

    def initialize(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._engine is not None:
            return self._session
        engine = self._module.TransferEngine()
        local = host if not port else f"{host}:{port}"
        try:
            ret = engine.initialize(local, self._metadata_server, self._protocol,
                                    self._device_name)
        except Exception as exc:
            raise EngineUnavailable(f"Mooncake initialize raised: {exc}") from exc
        if ret != 0:
            raise EngineUnavailable(
                f"Mooncake initialize({local!r}, {self._metadata_server!r}, "
                f"{self._protocol!r}) returned {ret}"
            )
        self._engine = engine
        self._session = f"{host}:{int(engine.get_rpc_port())}"
        return self._session

    def _live(self) -> Any:
        if self._engine is None:
            raise EngineError("Mooncake engine is not initialised (or already closed)")
        return self._engine

    def register_memory(self, addr: int, length: int) -> None:
        self._register_region(self._regions, self._live().register_memory, addr, length,
                              "Mooncake")

    def unregister_memory(self, addr: int) -> None:
        engine = self._live()
        self._regions.remove(int(addr))
        ret = engine.unregister_memory(int(addr))
        if ret != 0:
            raise RegistrationError(f"Mooncake unregister_memory(0x{int(addr):x}) returned {ret}")

    def batch_transfer_sync_read(
        self, session: str, local_addrs: Any, peer_addrs: Any, lengths: Any
    ) -> int:
        if self._engine is None:
            return self._fail(TransferResult.CLOSED, "Mooncake engine is not initialised")
        checked = self._preflight(session, local_addrs, peer_addrs, lengths, self._regions)
        if isinstance(checked, int):
            return checked
        return self._library_read(self._engine.batch_transfer_sync_read, session, *checked,
                                  "Mooncake")

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        addrs, _ = self._regions.snapshot()
        for addr in addrs:
            try:
                engine.unregister_memory(addr)
            except Exception:  # tearing down: keep releasing the rest
                pass
            self._regions.remove(addr)
        self._session = ""
