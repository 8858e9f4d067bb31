"""The README's pip route: a plain ``pip install`` of the project, without torch or CUDA,
runs the product - the demo, the model checker and the seeded-bug run.

It builds a fresh virtual environment in a temporary folder and installs the project into
it from PyPI (pip's cache makes a rerun quick). It is slow-ish, about a minute, and it runs
in CI like every other test: the pip route is a promise of the README."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a wheel is built from: the packages and the metadata files pyproject names.
SOURCES = ("pyproject.toml", "README.md", "spec", "statemachines", "runtime", "model_check")


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_plain_pip_install_runs_demo_check_and_mutants_without_torch(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in SOURCES:  # a copy, so the build writes nothing into the checkout
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    venv = tmp_path / "venv"
    t0 = time.monotonic()
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    assert made.returncode == 0, made.stderr
    pip = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                "--disable-pip-version-check", str(src)], tmp_path, 300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    install_s = time.monotonic() - t0
    print(f"fresh venv + pip install: {install_s:.1f}s")

    no_torch = _run([str(venv / "bin" / "python"), "-c", "import torch"], tmp_path, 60)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    # where pip finds a compiler it builds the READY id scanner; without one, the other route
    scanner = _run([str(venv / "bin" / "python"), "-c",
                    "from sfa_rd2h.spec import wire; print(wire.ID_SCANNER)"], tmp_path, 60)
    builds = shutil.which("gcc") and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    assert scanner.stdout.strip() == ("c" if builds else "python"), scanner

    exe = str(venv / "bin" / "sfa-rd2h")
    demo = _run([exe, "demo", "--requests", "4", "--layers", "4", "--json"], tmp_path, 120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    report = json.loads(demo.stdout)
    assert report["ok"] and report["trace_valid"] and report["verified"]
    assert report["requests_ok"] == 4 and report["topology"]["tp_group"] == "zmq"

    check = _run([exe, "check", "--budget", "20", "--examples", "50", "--quiet"], tmp_path, 120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("ok: 50 deployments explored")

    mutant = _run([exe, "mutants", "--only", "notify_before_landed", "--budget", "20",
                   "--json"], tmp_path, 120)
    assert mutant.returncode == 0, mutant.stdout + mutant.stderr
    [outcome] = json.loads(mutant.stdout)
    assert outcome["name"] == "notify_before_landed" and outcome["killed"]

    # Outside a checkout: the version is the installed one, and the checks that compare
    # committed files say there is nothing to compare rather than "stale".
    version = _run([exe, "--version"], tmp_path, 60)
    assert version.stdout.startswith("sfa-rd2h 0.") and "unknown" not in version.stdout
    diagrams = _run([exe, "diagrams", "--check"], tmp_path, 60)
    assert diagrams.returncode == 2 and "no diagrams folder" in diagrams.stderr
    ref = _run([exe, "reference", "--check"], tmp_path, 60)
    assert ref.returncode == 2 and "run from a checkout" in ref.stderr
