"""``sfa-rd2h validate``: replay trace files of real or model runs and report divergences."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sfa_rd2h.statemachines.trace import validate


def add_validate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``validate TRACE...`` to an argparse sub-command set; handler ``cmd_validate``."""
    p = subparsers.add_parser(
        "validate",
        help="replay JSON-lines traces through the machines and cross-process invariants",
        description="Exit 0 when the traces are valid, 1 at a divergence (printed with "
                    "file:line), 2 when a path is missing or unreadable or a folder holds no "
                    "trace.",
    )
    p.add_argument("traces", nargs="+", help="trace files or folders of *.jsonl files")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_validate)
    return p


class TraceArgumentError(ValueError):
    """A trace argument that names nothing readable: an I/O problem, not a divergence."""


def _expand(items: Sequence[str]) -> list[str]:
    """Trace files of the arguments: a folder gives its ``*.jsonl`` files. Raises
    ``TraceArgumentError`` for a missing path, an unreadable file or a folder without
    traces, so those are never reported as protocol divergences."""
    out: list[str] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise TraceArgumentError(f"no trace files (*.jsonl) found in {item}")
            out += [str(p) for p in found]
        elif not path.exists():
            raise TraceArgumentError(f"{item}: no such file or folder")
        elif not os.access(path, os.R_OK) or not path.is_file():
            raise TraceArgumentError(f"{item}: not a readable file")
        else:
            out.append(item)
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        paths = _expand(args.traces)
    except TraceArgumentError as exc:
        print(f"cannot validate: {exc}", file=sys.stderr)
        return 2
    report = validate(paths)
    if getattr(args, "json", False):
        print(json.dumps({
            "ok": report.ok, "files": report.files, "records": report.records,
            "transitions": report.transitions, "messages": report.messages,
            "divergences": [str(d) for d in report.divergences],
        }))
    else:
        print(report.summary())
    return 0 if report.ok else 1
