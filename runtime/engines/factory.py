"""Build a transfer engine by name, importing only the library that engine needs."""

from __future__ import annotations

from typing import Any

from sfa_rd2h.runtime.engines.base import EngineUnavailable, TransferEngine

ENGINE_NAMES = ("host", "memfabric", "mooncake")


def make_engine(name: str, **kw: Any) -> TransferEngine:
    """Build the engine called ``name`` ("host", "memfabric" or "mooncake").

    Raises ``EngineUnavailable`` for an unknown name or an engine whose library or device is
    missing here, so a misconfigured deployment fails at start-up, not at the first read.
    """
    if name == "host":
        from sfa_rd2h.runtime.engines.host import HostEngine

        return HostEngine(**kw)
    if name == "memfabric":
        from sfa_rd2h.runtime.engines.memfabric import MemFabricEngine

        return MemFabricEngine(**kw)
    if name == "mooncake":
        from sfa_rd2h.runtime.engines.mooncake import MooncakeEngine

        return MooncakeEngine(**kw)
    raise EngineUnavailable(
        f"unknown transfer engine {name!r}; known engines: {', '.join(ENGINE_NAMES)}"
    )
