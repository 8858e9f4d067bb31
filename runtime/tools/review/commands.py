"""``sfa-rd2h review`` and ``sfa-rd2h explain``: write the reviewer's pages."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import sfa_rd2h.statemachines as _machines_pkg
from sfa_rd2h.runtime.tools.review.page import PageError

REPO_ROOT = Path(_machines_pkg.__file__).resolve().parent.parent


def add_review_parsers(subparsers: Any) -> None:
    """Add ``review OLD NEW`` and ``explain SOURCE`` to an argparse sub-command set."""
    p = subparsers.add_parser(
        "review", help="a protocol change as a page: diagrams with the change drawn on them",
        description="Compare two spec snapshots (files, or git revisions of spec/snapshot.json "
                    "in this checkout) and write one self-contained HTML page: each machine "
                    "with added rows green, removed red and dashed, changed amber; clicking a "
                    "row or state shows both versions, its rules, their predicates, seeded "
                    "bugs and tests. Exit 2 for a source that is not a snapshot.")
    p.add_argument("old", help="snapshot JSON file or git revision (e.g. HEAD~1)")
    p.add_argument("new", help="snapshot JSON file or git revision")
    p.add_argument("--html", metavar="OUT", help="write the page here")
    p.add_argument("--markdown", action="store_true",
                   help="print the change list as Markdown (a pull-request comment)")
    p.set_defaults(func=cmd_review)
    p = subparsers.add_parser(
        "explain", help="step through a counterexample or a traced run in a page",
        description="Write one self-contained HTML page that steps through SOURCE: a checker "
                    "counterexample (check --counterexample FILE, or a list of them such as "
                    "mutants --pin's with --bug NAME) or a folder of traces (demo --trace-dir). "
                    "Exit 2 for a source that is neither.")
    p.add_argument("source", help="counterexample JSON or folder of *.jsonl traces")
    p.add_argument("--html", metavar="OUT", required=True, help="write the page here")
    p.add_argument("--bug", metavar="NAME", help="which counterexample of a list")
    p.set_defaults(func=cmd_explain)


def _write(path: str, text: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")


def cmd_review(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.tools.review import spec_page

    if not args.html and not args.markdown:
        print("review: say what to write: --html OUT and/or --markdown", file=sys.stderr)
        return 2
    try:
        old, old_label = spec_page.load_snapshot(args.old, REPO_ROOT)
        new, new_label = spec_page.load_snapshot(args.new, REPO_ROOT)
        tests = REPO_ROOT / "tests"
        data = spec_page.review_data(old, new, old_label, new_label,
                                     tests if tests.is_dir() else None)
        if args.html:
            _write(args.html, spec_page.render_html(data))
    except (PageError, RuntimeError) as exc:
        print(f"cannot review: {exc}", file=sys.stderr)
        return 2
    if args.markdown:
        sys.stdout.write(spec_page.render_markdown(data))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.tools.review import explain_page

    try:
        data = explain_page.explain_data(Path(args.source), args.bug)
        _write(args.html, explain_page.render_html(data))
    except (PageError, RuntimeError) as exc:
        print(f"cannot explain {args.source}: {exc}", file=sys.stderr)
        return 2
    return 0
