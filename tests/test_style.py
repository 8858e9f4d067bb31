"""The code base stays ruff clean (the project's lint rules live in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                          str(REPO)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
