"""``sfa-rd2h``: the command line over spec, machines, checker and runtime.

Each sub-command imports what it needs when it runs, so ``sfa-rd2h plan`` does not pay for
hypothesis or zmq imports.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import sfa_rd2h.statemachines as _machines_pkg

REPO_ROOT = Path(_machines_pkg.__file__).resolve().parent.parent


def _default_diagrams_dir() -> Path:
    here = REPO_ROOT / "diagrams"
    return here if here.is_dir() else Path.cwd() / "diagrams"


def cmd_diagrams(args: argparse.Namespace) -> int:
    from sfa_rd2h.statemachines import render

    out = Path(args.out) if args.out else _default_diagrams_dir()
    if args.check:
        stale = render.stale_diagrams(out)
        if stale:
            print(f"stale diagrams in {out}: {', '.join(stale)}; run 'sfa-rd2h diagrams'",
                  file=sys.stderr)
            return 1
        print(f"diagrams in {out} match the machines")
        return 0
    for path in render.write_diagrams(out, svg=not args.no_svg):
        print(f"wrote {path}")
    return 0


def cmd_spec_export(args: argparse.Namespace) -> int:
    from sfa_rd2h.statemachines import snapshot

    if args.check:
        path = Path(args.out) if args.out else snapshot.DEFAULT_PATH
        if not snapshot.is_fresh(path):
            print(f"{path} is stale; run 'sfa-rd2h spec export'", file=sys.stderr)
            return 1
        print(f"{path} matches the machines, wire schemas and rules")
        return 0
    if args.out == "-":
        sys.stdout.write(snapshot.dumps(snapshot.export_spec()))
        return 0
    path = snapshot.write_snapshot(Path(args.out) if args.out else snapshot.DEFAULT_PATH)
    print(f"wrote {path}")
    return 0


def cmd_spec_diff(args: argparse.Namespace) -> int:
    from sfa_rd2h.statemachines import snapshot

    try:
        old = json.loads(Path(args.old).read_text())
        new = json.loads(Path(args.new).read_text())
    except (OSError, ValueError) as exc:
        print(f"cannot read snapshot: {exc}", file=sys.stderr)
        return 2
    lines = snapshot.diff_specs(old, new)
    if not lines:
        print("no protocol changes")
        return 0
    print("\n".join(lines))
    return 1 if args.exit_code else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from sfa_rd2h.spec.errors import ProtocolError
    from sfa_rd2h.spec.topology import plan

    try:
        result = plan(args.p_tp, args.d_tp, args.kv_port, args.d_dp_rank)
    except ProtocolError as exc:
        print(f"invalid topology: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"p_tp={args.p_tp} d_tp={args.d_tp} kv_port={args.kv_port} "
          f"global d_dp_rank={args.d_dp_rank}")
    print("Prefill ranks (connect, never bind):")
    print(f"  {'p_rank':>6} {'d_rank':>6} {'member':>6} {'ratio':>5} {'remote_port':>11}")
    for row in result["prefill"]:
        print(f"  {row['p_rank']:>6} {row['d_rank']:>6} {row['group_member_idx']:>6} "
              f"{row['tp_ratio']:>5} {row['remote_port']:>11}")
    print("Decode ranks (bind a ROUTER):")
    print(f"  {'d_rank':>6} {'port':>6}")
    for row in result["decode"]:
        print(f"  {row['d_rank']:>6} {row['port']:>6}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from sfa_rd2h.model_check import checker

    profile = checker.default_profile()
    with tqdm(total=round(args.budget, 1), unit="s", desc="model check", leave=False,
              disable=args.quiet, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}") as bar:
        def progress(elapsed: float, examples: int) -> None:
            bar.n = min(round(elapsed, 1), bar.total)
            bar.set_postfix_str(f"{examples} deployments")

        result = checker.run_check(args.budget, args.seed, on_progress=progress, profile=profile,
                                   max_examples=args.examples)
    if result.ok:
        print(f"ok: {result.examples} deployments explored in {result.seconds:.1f}s "
              f"(seed {args.seed}, profile {profile}); no invariant broke")
        return 0
    print(f"FAILED after {result.examples} deployments ({result.seconds:.1f}s, seed {args.seed})")
    print(checker.format_counterexample(result))
    return 1


def cmd_mutants(args: argparse.Namespace) -> int:
    from sfa_rd2h.model_check import mutants

    def show(o: mutants.MutantOutcome) -> None:
        if args.json:
            return
        status = "killed" if o.killed else ("equivalent" if o.equivalent else "SURVIVED")
        secs = "-" if o.seconds is None else f"{o.seconds:.2f}"
        print(f"{o.name:30} {','.join(o.rules):10} {status:10} {secs:>7} "
              f"{'-' if o.steps is None else o.steps:>5}", flush=True)
        if o.equivalent:
            print(f"{'':30} equivalent: {o.equivalent}")

    if not args.json:
        print(f"{'bug':30} {'rules':10} {'result':10} {'secs':>7} {'steps':>5}")
    outcomes = mutants.run_mutants(args.budget, args.seed, args.only or None, on_result=show)
    survivors = [o.name for o in outcomes if not o.killed and not o.equivalent]
    if args.pin:
        _pin_counterexamples(Path(args.pin), outcomes)
    if args.json:
        print(json.dumps([o.as_json() for o in outcomes], indent=2))
    else:
        times = sorted(o.seconds for o in outcomes if o.seconds is not None)
        if times:
            print(f"killed {len(times)}/{len(outcomes)}; median time to first failure "
                  f"{times[len(times) // 2]:.2f}s")
        if survivors:
            print(f"survived: {', '.join(survivors)}")
    return 1 if survivors else 0


def _pin_counterexamples(path: Path, outcomes: list) -> None:
    """Keep each killed bug's minimal counterexample as a regression test input."""
    from sfa_rd2h.model_check.cluster import scope_to_json

    entries = json.loads(path.read_text()) if path.exists() else []
    by_name = {e["name"]: e for e in entries}
    for o in outcomes:
        if o.killed and o.scope is not None:
            last = o.counterexample[-1] if o.counterexample else ""
            error = last.split(" raised ", 1)[-1] if " raised " in last else last
            by_name[o.name] = {"name": o.name, "scope": scope_to_json(o.scope),
                               "ops": [list(op) for op in o.ops or []],
                               "error": ":".join(error.split(":")[:2]).strip()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sorted(by_name.values(), key=lambda e: e["name"]), indent=1)
                    + "\n")


def cmd_explore(args: argparse.Namespace) -> int:
    from sfa_rd2h.model_check.explore import SCOPES, explore
    from sfa_rd2h.model_check.invariants import InvariantViolation

    try:
        result = explore(SCOPES[args.scope], max_states=args.max_states)
    except InvariantViolation as exc:
        print(f"FAILED: {exc}")
        return 1
    status = "complete" if result.complete else f"stopped at {args.max_states} states"
    print(f"{result.states} distinct states, {result.transitions} transitions, "
          f"{result.final_states} final state(s), depth {result.depth}, "
          f"{result.seconds:.1f}s ({status}); every invariant held")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sfa-rd2h",
        description="RD2H KV-transfer protocol: spec, diagrams, model checker and runtime.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("diagrams", help="write DOT and SVG diagrams of every machine")
    p.add_argument("--out", help="output folder (default: the repository's diagrams/)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the committed DOT differs from the machines")
    p.add_argument("--no-svg", action="store_true", help="write DOT only")
    p.set_defaults(func=cmd_diagrams)

    p = sub.add_parser("spec", help="the reviewable spec snapshot")
    spec_sub = p.add_subparsers(dest="spec_command", required=True)
    e = spec_sub.add_parser("export", help="write the canonical JSON snapshot (spec/snapshot.json)")
    e.add_argument("--out", help="path, or - for stdout")
    e.add_argument("--check", action="store_true", help="exit 1 if the snapshot is stale")
    e.set_defaults(func=cmd_spec_export)
    d = spec_sub.add_parser("diff", help="review the protocol changes between two snapshots")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("--exit-code", action="store_true", help="exit 1 when anything changed")
    d.set_defaults(func=cmd_spec_diff)

    p = sub.add_parser("plan", help="print the TP rank and port mapping of a deployment")
    p.add_argument("--p-tp", type=int, required=True, help="Prefill tensor-parallel size")
    p.add_argument("--d-tp", type=int, required=True, help="Decode tensor-parallel size")
    p.add_argument("--kv-port", type=int, required=True, help="configured kv_port")
    p.add_argument("--d-dp-rank", type=int, default=0, help="Decode global DP rank")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("check", help="model-check the protocol cores (hypothesis, stateful)")
    p.add_argument("--budget", type=float, default=60.0, help="seconds to explore (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first batch")
    p.add_argument("--examples", type=int, default=None,
                   help="stop after this many deployments (machine-independent, for CI)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("mutants", help="run the checker against every seeded bug")
    p.add_argument("--budget", type=float, default=30.0, help="seconds per bug (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", help="run only this bug (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--pin", help="write killed bugs' minimal counterexamples to this JSON file")
    p.set_defaults(func=cmd_mutants)

    from sfa_rd2h.runtime.tools.bench import add_bench_parser
    from sfa_rd2h.runtime.tools.demo import add_demo_parser
    from sfa_rd2h.runtime.tools.probe import add_probe_parser
    from sfa_rd2h.runtime.tools.validate import add_validate_parser

    add_demo_parser(sub)
    add_validate_parser(sub)
    add_probe_parser(sub)
    add_bench_parser(sub)

    p = sub.add_parser("explore", help="exhaustively explore the pinned small scope")
    p.add_argument("--max-states", type=int, default=None)
    p.add_argument("--scope", choices=["pinned", "wide"], default="pinned",
                   help="pinned: the CI scope with a pinned count; wide: two Decode "
                        "instances sharing Prefill slots (nightly, about a minute)")
    p.set_defaults(func=cmd_explore)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
