"""Transfer engines behind one MemFabric-shaped interface (PROTOCOL X1): host, MemFabric,
Mooncake. Import ``make_engine`` and the interface from here; engine modules load lazily so
a CPU machine never imports an accelerator library it does not have."""

from sfa_rd2h.runtime.engines.base import (
    EngineConfigError,
    EngineError,
    EngineUnavailable,
    RegistrationError,
    TransferEngine,
    TransferResult,
    tensor_region,
)
from sfa_rd2h.runtime.engines.factory import ENGINE_NAMES, make_engine

__all__ = [
    "ENGINE_NAMES",
    "EngineConfigError",
    "EngineError",
    "EngineUnavailable",
    "RegistrationError",
    "TransferEngine",
    "TransferResult",
    "make_engine",
    "tensor_region",
]
