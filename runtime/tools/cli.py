"""``sfa-rd2h``: the command line over spec, machines, checker and runtime.

Each sub-command imports what it needs when it runs, so ``sfa-rd2h plan`` does not pay for
hypothesis or zmq imports.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import sfa_rd2h.statemachines as _machines_pkg

REPO_ROOT = Path(_machines_pkg.__file__).resolve().parent.parent


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("sfa-rd2h")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value


def _default_diagrams_dir() -> Path:
    here = REPO_ROOT / "diagrams"
    return here if here.is_dir() else Path.cwd() / "diagrams"


def cmd_diagrams(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.tools import sequence
    from sfa_rd2h.statemachines import render

    if args.sequence:
        return _sequence(args)
    out = Path(args.out) if args.out else _default_diagrams_dir()
    if args.check:
        if not out.is_dir():
            # Outside a checkout there is nothing committed to compare with: say that,
            # rather than calling a folder that does not exist "stale".
            print(f"no diagrams folder at {out}: run from a checkout of sfa-rd2h, or pass "
                  "--out DIR", file=sys.stderr)
            return 2
        stale = render.stale_diagrams(out) + sequence.stale_example(out)
        if stale:
            print(f"stale diagrams in {out}: {', '.join(stale)}; run 'sfa-rd2h diagrams'",
                  file=sys.stderr)
            return 1
        print(f"diagrams in {out} match the machines and the example run")
        return 0
    written = render.write_diagrams(out, svg=not args.no_svg)
    written += sequence.write_example(out, svg=not args.no_svg)
    for path in written:
        print(f"wrote {path}")
    return 0


def _sequence(args: argparse.Namespace) -> int:
    """``diagrams --sequence TRACE_DIR``: one sequence diagram of a traced run."""
    from sfa_rd2h.runtime.tools import sequence
    from sfa_rd2h.statemachines import render

    folder = Path(args.sequence)
    try:
        dot = sequence.dot_from_traces(sequence.trace_files(folder),
                                       title=f"run traced in {folder}")
    except (OSError, ValueError) as exc:
        print(f"cannot draw {folder}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path.cwd()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sequence.dot"
    path.write_text(dot)
    print(f"wrote {path}")
    if not args.no_svg:
        svg = out / "sequence.svg"
        svg.write_text(render.render_svg(dot))
        print(f"wrote {svg}")
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.tools import reference

    path = Path(args.out) if args.out else reference.DEFAULT_PATH
    tests = REPO_ROOT / "tests"
    if not tests.is_dir():
        print(f"the protocol reference lists the tests that exercise each rule; no tests "
              f"folder at {tests}: run from a checkout of sfa-rd2h", file=sys.stderr)
        return 2
    text = reference.generate(tests)
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale; run 'sfa-rd2h reference'", file=sys.stderr)
            return 1
        print(f"{path} matches the rules, tables, checker and tests")
        return 0
    path.write_text(text)
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

    specs = []
    for name in (args.old, args.new):
        try:
            obj = json.loads(Path(name).read_text())
        except OSError as exc:
            print(f"cannot read {name}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"{name} is not JSON: {exc}", file=sys.stderr)
            return 2
        problem = snapshot.not_a_snapshot(obj)
        if problem:
            print(f"{name} is not a spec snapshot ({problem}); make one with "
                  "'sfa-rd2h spec export --out FILE'", file=sys.stderr)
            return 2
        specs.append(obj)
    old, new = specs
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


class _CheckProgress:
    """What a running check is doing, for the progress bar: searching (deployments so far)
    or shrinking a counterexample. Written by the checker's callbacks, read by the ticker."""

    def __init__(self) -> None:
        self.begin("")

    def begin(self, label: str) -> None:
        self.label = label
        self.examples = 0
        self.started = time.monotonic()
        self.shrinking_since: float | None = None

    def searched(self, elapsed: float, examples: int) -> None:
        self.examples = examples

    def shrink(self) -> None:
        self.shrinking_since = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def text(self) -> str:
        head = f"{self.label}: " if self.label else ""
        if self.shrinking_since is not None:
            return (f"{head}failure found, shrinking the counterexample "
                    f"{time.monotonic() - self.shrinking_since:.0f}s")
        return f"{head}{self.examples} deployments"


def cmd_check(args: argparse.Namespace) -> int:
    from sfa_rd2h.model_check import checker
    from sfa_rd2h.runtime.tools.progress import Ticker

    profile = checker.default_profile()
    state = _CheckProgress()
    ticker = Ticker(lambda: (args.budget if state.shrinking_since else state.elapsed(),
                             state.text()), total=args.budget,
                    desc="model check", unit="s", disable=args.quiet,
                    bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}")
    with ticker:
        result = checker.run_check(args.budget, args.seed, on_progress=state.searched,
                                   profile=profile, max_examples=args.examples,
                                   on_shrink=state.shrink)
    if result.ok:
        print(f"ok: {result.examples} deployments explored in {result.seconds:.1f}s "
              f"(seed {args.seed}, profile {profile}); no invariant broke")
        return 0
    print(f"FAILED after {result.examples} deployments ({result.seconds:.1f}s, seed {args.seed})")
    print(checker.format_counterexample(result))
    if args.counterexample:
        _write_counterexample(Path(args.counterexample), None, result.scope, result.ops,
                              result.counterexample, result.error)
    return 1


def _write_counterexample(path: Path, bug: str | None, scope: object, ops: list | None,
                          steps: list[str], error: str) -> None:
    """A shrunk counterexample as JSON: what ``sfa-rd2h explain`` replays."""
    from sfa_rd2h.model_check.cluster import scope_to_json

    entry = {"bug": bug, "scope": scope_to_json(scope), "ops": [list(op) for op in ops or []],
             "error": error.splitlines()[0] if error else "", "steps": list(steps)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=1) + "\n")
    print(f"wrote {path} (sfa-rd2h explain {path} --html OUT steps through it)",
          file=sys.stderr)


def cmd_mutants(args: argparse.Namespace) -> int:
    from sfa_rd2h.model_check import mutants
    from sfa_rd2h.runtime.tools.progress import Ticker

    if args.list:
        for bug in mutants.BUGS:
            print(f"{bug.name:30} {','.join(bug.rules):10} {bug.doc.splitlines()[0]}")
        return 0
    unknown = sorted(set(args.only or ()) - set(mutants.BY_NAME))
    if unknown:
        print(f"unknown seeded bug(s): {', '.join(unknown)}\nknown bugs (sfa-rd2h mutants "
              f"--list): {', '.join(mutants.BY_NAME)}", file=sys.stderr)
        return 2
    selected = [b for b in mutants.BUGS if not args.only or b.name in args.only]
    state = _CheckProgress()
    done = [0]
    ticker = Ticker(lambda: (done[0], state.text() if state.shrinking_since else
                             f"{state.text()}, {state.elapsed():.0f}s"),
                    total=len(selected), desc="mutants", unit="bug",
                    disable=args.quiet or args.json)

    def start(bug: mutants.SeededBug) -> None:
        state.begin(bug.name)

    def show(o: mutants.MutantOutcome) -> None:
        done[0] += 1
        if args.json:
            return
        status = "killed" if o.killed else ("equivalent" if o.equivalent else "SURVIVED")
        secs = "-" if o.seconds is None else f"{o.seconds:.2f}"
        ticker.write(f"{o.name:30} {','.join(o.rules):10} {status:10} {secs:>7} "
                     f"{'-' if o.steps is None else o.steps:>5}")
        if o.equivalent:
            ticker.write(f"{'':30} equivalent: {o.equivalent}")

    if not args.json:
        print(f"{'bug':30} {'rules':10} {'result':10} {'secs':>7} {'steps':>5}", flush=True)
    with ticker:
        outcomes = mutants.run_mutants(args.budget, args.seed, args.only or None,
                                       on_result=show, on_start=start,
                                       on_progress=state.searched, on_shrink=state.shrink)
    survivors = [o.name for o in outcomes if not o.killed and not o.equivalent]
    if args.pin:
        _pin_counterexamples(Path(args.pin), outcomes)
    if args.counterexamples:
        for o in outcomes:
            if o.killed and o.scope is not None:
                last = o.counterexample[-1] if o.counterexample else ""
                _write_counterexample(Path(args.counterexamples) / f"{o.name}.json", o.name,
                                      o.scope, o.ops, o.counterexample,
                                      last.split(" raised ", 1)[-1])
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
    from sfa_rd2h.runtime.tools.progress import Ticker

    seen = [0]

    def status() -> tuple[float, str]:
        return seen[0], f"{ticker.elapsed():.0f}s"

    ticker = Ticker(status, total=args.max_states, desc=f"explore {args.scope}",
                    unit=" states", disable=args.quiet)
    try:
        with ticker:
            result = explore(SCOPES[args.scope], max_states=args.max_states,
                             on_progress=lambda n: seen.__setitem__(0, n))
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
    parser.add_argument("--version", action="version", version=f"sfa-rd2h {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("diagrams", help="write DOT and SVG diagrams of every machine",
                       description="Draw every machine of the tables, and the sequence "
                                   "diagram of a small deterministic model-checker run, as "
                                   "DOT and SVG; or, with --sequence, the sequence diagram "
                                   "of any traced run.")
    p.add_argument("--out", help="output folder (default: the repository's diagrams/; with "
                                 "--sequence, the current folder)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the committed DOT differs from the machines")
    p.add_argument("--no-svg", action="store_true", help="write DOT only")
    p.add_argument("--sequence", metavar="TRACE_DIR",
                   help="draw the run traced in this folder (*.jsonl, e.g. demo --trace-dir) "
                        "as sequence.dot/.svg: processes as lifelines, messages as arrows, "
                        "the transitions they fire")
    p.set_defaults(func=cmd_diagrams)

    p = sub.add_parser("reference", help="write the protocol reference spec/PROTOCOL.md",
                       description="Generate spec/PROTOCOL.md from the rule catalog, the "
                                   "tables, the checker's predicates, the seeded bugs and the "
                                   "tests' rule comments (needs a checkout: it reads tests/).")
    p.add_argument("--out", help="path (default: spec/PROTOCOL.md of the checkout)")
    p.add_argument("--check", action="store_true", help="exit 1 if the reference is stale")
    p.set_defaults(func=cmd_reference)

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
    p.add_argument("--budget", type=_positive_float, default=60.0,
                   help="seconds to explore (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first batch")
    p.add_argument("--examples", type=_positive_int, default=None,
                   help="stop after exactly this many deployments (machine-independent, "
                        "for CI)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--counterexample", metavar="FILE",
                   help="on failure, also write the counterexample as JSON (sfa-rd2h explain "
                        "reads it)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("mutants", help="run the checker against every seeded bug")
    p.add_argument("--budget", type=_positive_float, default=30.0,
                   help="seconds per bug (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", metavar="NAME",
                   help="run only this bug (repeatable; --list names them)")
    p.add_argument("--list", action="store_true", help="list the seeded bugs and exit")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--pin", help="write killed bugs' minimal counterexamples to this JSON file")
    p.add_argument("--counterexamples", metavar="DIR",
                   help="write each killed bug's counterexample as DIR/NAME.json (sfa-rd2h "
                        "explain reads them)")
    p.set_defaults(func=cmd_mutants)

    from sfa_rd2h.runtime.tools.bench.serving import add_vllm_bench_parser
    from sfa_rd2h.runtime.tools.bench.suite import add_bench_parser
    from sfa_rd2h.runtime.tools.demo import add_demo_parser
    from sfa_rd2h.runtime.tools.hosts import add_hosts_parser
    from sfa_rd2h.runtime.tools.mutation import add_mutation_parser
    from sfa_rd2h.runtime.tools.probe import add_probe_parser
    from sfa_rd2h.runtime.tools.review.commands import add_review_parsers
    from sfa_rd2h.runtime.tools.validate import add_validate_parser
    from sfa_rd2h.runtime.tools.vllm_demo import add_vllm_demo_parser

    add_demo_parser(sub)
    add_vllm_demo_parser(sub)
    add_vllm_bench_parser(sub)
    add_validate_parser(sub)
    add_probe_parser(sub)
    add_hosts_parser(sub)
    add_bench_parser(sub)
    add_mutation_parser(sub)
    add_review_parsers(sub)

    p = sub.add_parser("explore", help="exhaustively explore the pinned small scope")
    p.add_argument("--max-states", type=_positive_int, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--scope", choices=["pinned", "wide", "early"], default="pinned",
                   help="pinned: the CI scope with a pinned count; wide: two Decode "
                        "instances sharing Prefill slots (nightly, about a minute); early: "
                        "Prefill dispatched before the rendezvous, Decode holding a prefix "
                        "block itself (C3, C5)")
    p.set_defaults(func=cmd_explore)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # One line, however often Ctrl-C is pressed: later presses are ignored from here.
        # The demo handles Ctrl-C itself (it has processes and /dev/shm files to clean up).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"interrupted: sfa-rd2h {args.command} stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
