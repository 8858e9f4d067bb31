"""``sfa-rd2h mutation``: mutation testing of the runtime adapters and the codec (issue 12).

The sans-IO cores are guarded by the model checker and its seeded bugs; the code around them
(control plane, transfer engines, metaserver, TP agreement, trace validator, codec, layout)
is guarded by the test suite, and this command measures how well: it runs ``mutmut`` 3 over
the files in ``TARGETS``, each mutant against only the tests that execute the function it
changes, and reports the score and every survivor by file and function. Survivors that
cannot be told from the original by any test (equivalent mutants) are recorded, with the
reason, in ``tests/data/equivalent_mutants.json`` and excluded from the score.

How it works. mutmut names a mutant after the module its file would be imported as, and the
tests import ``sfa_rd2h.spec.wire`` while the file lives at ``spec/wire.py``; so the command
stages the package as ``build/mutation/sfa_rd2h/...`` next to a copy of ``tests/`` and runs
mutmut there (``build/`` is ignored by git; results survive between runs, so a second run
only tests what changed). mutmut first runs the selected tests once to record which test
reaches which function; a small hook also records the functions that processes spawned by a
test reach (the gloo ranks, the host-engine peers), so those tests are selected too. Each
mutant then runs in a forked worker with the tests that reach it, fastest first, stopping at
the first failure.

    sfa-rd2h mutation                      # every target (2-4 hours on 2 cores, see README)
    sfa-rd2h mutation --only runtime/tp_group.py   # one file, a few minutes
    sfa-rd2h mutation --report [--json]    # the last run's score and survivors, no run

mutmut tests the mutants of all staged files cheapest first, across files; ``--mutants``
narrows a run to some of them (by mutmut's name, e.g. ``sfa_rd2h.spec.wire.*``) without
re-staging, so the statistics of the other staged files are kept.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = "sfa_rd2h"
# What the package's folders are called inside ``sfa_rd2h`` (pyproject's package-dir).
PACKAGE_DIRS = ("spec", "statemachines", "runtime", "model_check")

# The files mutated, relative to the repository root (= inside the package).
TARGETS = (
    "runtime/control.py",
    "runtime/engines/*.py",
    "runtime/metaserver.py",
    "statemachines/trace.py",
    "runtime/tp_group.py",
    "spec/wire*.py",  # the facade spec/wire.py and its parts spec/wire_*.py
    "spec/layout.py",
)
# Not mutated although a target pattern matches them, and why.
EXCLUDED = {
    "runtime/engines/fake_memfabric.py": "a test double: the oracle the MemFabric engine's "
                                         "tests run against, not product code",
    "runtime/engines/__init__.py": "re-exports only",
}
# The tests a mutant may be checked with (mutmut picks, per mutant, those that reach it).
# Left out: multi-process end-to-end runs (minutes each, and a mutant only reaches them in
# child processes), the pip-route venv build, static checks (style, layering, snapshot),
# the model checker's long runs and the receivers' fuzzing (model_check and the cores are
# guarded by the seeded bugs, ``sfa-rd2h mutants``).
TEST_FILES = (
    "tests/test_wire.py",
    "tests/test_layout.py",
    "tests/test_engines.py",
    "tests/test_engine_small_batch.py",
    "tests/test_metaserver.py",
    "tests/test_tp_group.py",
    "tests/test_control.py",
    "tests/test_control_decode_loop.py",
    "tests/test_trace_validator.py",
    "tests/test_trace_replies.py",
    "tests/test_robustness.py",
    "tests/test_cores.py",
    "tests/test_machines.py",
    "tests/test_topology.py",
)
# Left out of the selection although they reach mutated code: each costs seconds per mutant
# that survives (every spec/wire.py and spec/layout.py mutant selected them; together they
# were 18 of the 23 s a surviving layout mutant cost), and what they check is covered by
# faster tests that run first.
DESELECTED = {
    "tests/test_cores.py::test_cost_per_event_does_not_grow_with_waiting_readys":
        "a work bound: 20,000 READYs queued per run; decoding them is checked by "
        "test_wire and test_cores' own cases",
    "tests/test_control.py::test_a_slow_registry_stalls_only_its_own_peer":
        "waits out a registry that never answers (lanes, not codec or layout logic)",
    "tests/test_robustness.py::test_ready_memory_is_bounded_by_the_bytes_received":
        "bounds a child process's RSS, which mutmut's trampolines grow (~7 MB left after "
        "the READY is answered, over the test's 6.5 MB); the plain suite runs it",
}
# pytest-timeout per test under a mutant: a mutant may hang a wait. Each test is bounded by
# TIMEOUT_FACTOR times its unmutated duration (mutmut's stats), at least PER_TEST_FLOOR_S;
# PER_TEST_TIMEOUT_S for a test the stats do not time. Unmutated, the selected tests take
# under 5 s each (gloo's under 25 s under load); a mutant slowing one down past its bound is
# counted as detected, which is what a user would see too.
PER_TEST_TIMEOUT_S = 30
PER_TEST_FLOOR_S = 10
TIMEOUT_FACTOR = 5
# mutmut's own bounds on a mutant's worker: wall time (estimate + constant) x multiplier,
# CPU time twice that (the estimate: the unmutated durations of its selected tests). Its
# defaults (1 s, x15) let a mutant spinning in a loop burn 30x its tests' time in CPU on a
# 2-core machine, which was a third of a run's time; x4 still leaves a surviving mutant,
# whose every test runs beside three other workers, four times its estimate.
MUTMUT_TIMEOUT_CONSTANT_S = 2.0
MUTMUT_TIMEOUT_MULTIPLIER = 4.0
# The same bound for mutmut's stats and clean-suite passes, which run every selected test
# unmutated: the spawned gloo ranks of test_tp_group take 20 s alone and over 60 s beside
# other load, and a timeout there stops the whole run.
CLEAN_TEST_TIMEOUT_S = 300
EQUIVALENTS = Path("tests/data/equivalent_mutants.json")
STAGE = Path("build/mutation")
HITS_ENV = "SFA_RD2H_MUTATION_HITS"
FAILURES_ENV = "SFA_RD2H_MUTATION_FAILURES"
FAILURES = "unmutated-failures.log"  # in the stage: tests that failed without a mutant
STATS_FILES = "stats_files.json"  # in the stage: the targets mutmut's stats were taken for

# mutmut's exit-code convention (mutmut.stats.status_by_exit_code), restated so that the
# report can be read without importing mutmut.
_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
           34: "skipped", 35: "suspicious", 36: "timeout", 37: "caught by type check",
           -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", -11: "segfault",
           -9: "segfault", None: "not checked", 2: "interrupted"}
# Counted as detected: a test failed, the mutant hung past its bound or crashed the worker.
DETECTED = frozenset({"killed", "timeout", "segfault", "caught by type check"})
# Counted against the score: the suite ran and noticed nothing, or nothing ran it.
UNDETECTED = frozenset({"survived", "no tests", "suspicious"})

# A processes spawned by a test (multiprocessing spawn, subprocess) records which mutated
# functions it reached during the stats run; the plugin below hands them to mutmut under
# the test that spawned it (``PYTEST_CURRENT_TEST`` is inherited), so mutants of code that
# only runs in child processes get those tests instead of none.
_SITECUSTOMIZE = '''\
"""Staged by sfa-rd2h mutation: child processes report the mutated functions they reached."""
import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("{hits_env}"):
    import atexit
    import json
    import sys

    def _sfa_rd2h_dump_hits():
        state = sys.modules.get("mutmut.state")
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        if state is None or not test:
            return
        hits = sorted(state.state()._stats)
        if hits:
            path = os.path.join(os.environ["{hits_env}"], "%d.json" % os.getpid())
            with open(path, "w") as f:
                json.dump({{"test": test, "hits": hits}}, f)

    atexit.register(_sfa_rd2h_dump_hits)
'''

_PLUGIN = '''\
"""Staged by sfa-rd2h mutation (pytest -p sfa_rd2h_mutation_plugin)."""
import json
import os
from pathlib import Path

import pytest


def _merge_child_hits():
    folder = os.environ.get("{hits_env}")
    if not folder or os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.state import state

    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for name in data["hits"]:
            state().tests_by_mangled_function_name[name].add(data["test"])
        path.unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    _merge_child_hits()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    _merge_child_hits()


@pytest.hookimpl
def pytest_runtest_logreport(report):
    """mutmut shows no test output when an unmutated pass fails: keep what failed."""
    log = os.environ.get("{failures_env}")
    if report.failed and log and os.environ.get("MUTANT_UNDER_TEST") in ("stats", ""):
        with open(log, "a") as f:
            f.write(f"{{report.nodeid}} ({{report.when}})\\n{{report.longreprtext}}\\n\\n")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Fastest tests first, so a mutant is usually killed by its cheapest test. Unmutated
    passes (stats, clean suite) get the looser bound: there a timeout is load, not a hang."""
    unmutated = os.environ.get("MUTANT_UNDER_TEST") in ("stats", "")
    if unmutated:
        for item in items:
            item.add_marker(pytest.mark.timeout({clean_timeout}))
    try:
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
    if not unmutated:
        for item in items:
            if item.nodeid in durations:
                bound = max({floor}, {factor} * durations[item.nodeid])
                item.add_marker(pytest.mark.timeout(round(bound, 1)))
'''


# --------------------------------------------------------------------------- staging


def repo_root() -> Path:
    """The checkout this module belongs to (the command needs one: it copies ``tests/``)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "tests").is_dir():
            return parent
    raise FileNotFoundError("sfa-rd2h mutation needs a checkout (pyproject.toml and tests/)")


def target_files(root: Path, only: Sequence[str] = ()) -> list[str]:
    """The mutated files (repo-relative), expanded from ``TARGETS`` minus ``EXCLUDED``;
    ``only`` narrows them to those matching any of its patterns."""
    found: set[str] = set()
    for pattern in TARGETS:
        for path in root.glob(pattern):
            rel = path.relative_to(root).as_posix()
            if rel not in EXCLUDED:
                found.add(rel)
    if only:
        found = {f for f in found if any(fnmatch.fnmatch(f, p) for p in only)}
    return sorted(found)


def _toml_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def mutmut_config(files: Sequence[str], tests: Sequence[str]) -> str:
    """The ``[tool.mutmut]`` table of the staged pyproject.toml."""
    return (
        "\n[tool.mutmut]\n"
        f'source_paths = ["{PACKAGE}"]\n'
        f"only_mutate = {_toml_list(f'{PACKAGE}/{f}' for f in files)}\n"
        "pytest_add_cli_args_test_selection = "
        f"{_toml_list([*tests, *(a for n in DESELECTED for a in ('--deselect', n))])}\n"
        f'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "sfa_rd2h_mutation_plugin", '
        f'"--timeout={PER_TEST_TIMEOUT_S}"]\n'
        'process_isolation = "forkserver"\n'
        f"timeout_constant = {MUTMUT_TIMEOUT_CONSTANT_S}\n"
        f"timeout_multiplier = {MUTMUT_TIMEOUT_MULTIPLIER}\n"
        "use_git_change_detection = false\n"
    )


def stage(root: Path, stage_dir: Path, files: Sequence[str], tests: Sequence[str],
          fresh: bool) -> None:
    """Lay out ``stage_dir``: the package under its import name, the tests, the project's
    pytest settings plus mutmut's, and the two hooks. Unchanged files keep their times, so
    mutmut re-tests only the functions that changed since its last run."""
    if fresh and stage_dir.exists():
        shutil.rmtree(stage_dir)
    pkg = stage_dir / PACKAGE
    for name in PACKAGE_DIRS:
        _sync_tree(root / name, pkg / name)
    _sync_tree(root / "tests", stage_dir / "tests")
    text = (root / "pyproject.toml").read_text()
    cut = text.find("\n[tool.mutmut]")
    if cut != -1:
        text = text[:cut] + "\n"
    _write_if_changed(stage_dir / "pyproject.toml", text + mutmut_config(files, tests))
    hooks = stage_dir / "hooks"
    _write_if_changed(hooks / "sitecustomize.py", _SITECUSTOMIZE.format(hits_env=HITS_ENV))
    _write_if_changed(hooks / "sfa_rd2h_mutation_plugin.py",
                      _PLUGIN.format(hits_env=HITS_ENV, failures_env=FAILURES_ENV,
                                     clean_timeout=CLEAN_TEST_TIMEOUT_S,
                                     floor=PER_TEST_FLOOR_S, factor=TIMEOUT_FACTOR))
    (stage_dir / "mutants").mkdir(parents=True, exist_ok=True)  # on PYTHONPATH from the start
    _refresh_unmutated(pkg, stage_dir / "mutants" / PACKAGE, {f"{PACKAGE}/{f}" for f in files})
    _forget_stats_unless_covering(stage_dir, files, _tests_digest(stage_dir, tests))
    _retest_undetected(stage_dir / "mutants", files)
    hits = stage_dir / "hits"
    shutil.rmtree(hits, ignore_errors=True)
    hits.mkdir()


def _sync_tree(src: Path, dst: Path) -> None:
    """Mirror ``src`` into ``dst`` (Python sources and data; no caches), keeping the times of
    files whose bytes did not change."""
    wanted: set[Path] = set()
    for path in src.rglob("*"):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        rel = path.relative_to(src)
        wanted.add(rel)
        target = dst / rel
        if not target.exists() or target.read_bytes() != path.read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    if dst.exists():
        for path in dst.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and \
                    path.relative_to(dst) not in wanted:
                path.unlink()


def _tests_digest(stage_dir: Path, tests: Sequence[str]) -> str:
    """One hash over the staged tests and the selection (test files, deselected tests)."""
    h = hashlib.sha256(json.dumps([list(tests), sorted(DESELECTED)]).encode())
    for path in sorted((stage_dir / "tests").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(path.relative_to(stage_dir).as_posix().encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


def _forget_stats_unless_covering(stage_dir: Path, files: Sequence[str], tests: str) -> None:
    """mutmut's stats (which test reaches which function) are dropped, so that mutmut
    collects them anew with every selected test, unless they were taken for a superset of
    ``files`` with the same tests (digest ``tests``). Two reasons: mutmut takes them only
    for the files it mutated then, so a file added to the targets since would get no tests
    ("no tests"); and its incremental pass for changed tests runs them without the
    configured ``--deselect`` and fails ("failed to collect stats") on the slow tests
    deselected here. A full pass costs a few minutes; the mutants' results are kept."""
    record = stage_dir / STATS_FILES
    try:
        taken = json.loads(record.read_text())
        covered, digest = set(taken["files"]), taken["tests"]
    except (OSError, ValueError, KeyError, TypeError):
        covered, digest = set(), None
    if not set(files) <= covered or digest != tests:
        (stage_dir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    # mutmut keeps stats only for the files of its latest run: the record narrows with it
    _write_if_changed(record, json.dumps({"files": sorted(files), "tests": tests}))


def _retest_undetected(mutants: Path, files: Sequence[str]) -> None:
    """mutmut keeps a mutant's result until its function changes; a survivor would stay a
    survivor after a test that kills it was added. So the targets' undetected mutants
    (survived, no tests, suspicious) are marked untested and run again; detected ones keep
    their result."""
    for f in files:
        meta = mutants / PACKAGE / (f + ".meta")
        if not meta.exists():
            continue
        data = json.loads(meta.read_text())
        codes = data.get("exit_code_by_key", {})
        again = [k for k, c in codes.items() if _STATUS.get(c, "suspicious") in UNDETECTED]
        if again:
            codes.update(dict.fromkeys(again))
            meta.write_text(json.dumps(data, indent=4))


def _refresh_unmutated(pkg: Path, mutated_pkg: Path, targets: set[str]) -> None:
    """mutmut copies a file it does not mutate into ``mutants/`` once and never again; bring
    those copies up to date (a changed core must not be tested in its old version). A file
    mutated in an earlier run and changed since loses its stale results."""
    if not mutated_pkg.is_dir():
        return
    for src in pkg.rglob("*.py"):
        rel = src.relative_to(pkg)
        if f"{PACKAGE}/{rel.as_posix()}" in targets:
            # mutmut regenerates it when the source is newer; but a plain copy it made in
            # an earlier run where the file was not a target (it copies every file it does
            # not mutate, every run) is newer than its source: mutmut would take it as
            # mutated and run its mutants against unmutated code. Dropped, it is mutated
            # again; results of unchanged functions are kept (mutmut matches their hashes).
            dst = mutated_pkg / rel
            if dst.exists() and (not dst.with_name(dst.name + ".meta").exists()
                                 or dst.read_bytes() == src.read_bytes()):
                dst.unlink()
            continue
        dst = mutated_pkg / rel
        meta = dst.with_name(dst.name + ".meta")
        if meta.exists():
            if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
                continue  # mutated earlier, unchanged since: keep it and its results
            meta.unlink()
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def mutmut_env(stage_dir: Path) -> dict[str, str]:
    """The environment mutmut runs in: staged hooks first, then the mutated tree, so every
    process a test starts (spawn or subprocess) imports the mutants, not the checkout."""
    env = dict(os.environ)
    paths = [str((stage_dir / "hooks").resolve()), str((stage_dir / "mutants").resolve())]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[HITS_ENV] = str((stage_dir / "hits").resolve())
    env[FAILURES_ENV] = str((stage_dir / FAILURES).resolve())
    env.pop("MUTANT_UNDER_TEST", None)
    return env


def run_mutmut(stage_dir: Path, max_children: int, names: Sequence[str] = ()) -> int:
    exe = Path(sys.executable).with_name("mutmut")
    if not exe.exists():
        found = shutil.which("mutmut")
        if found is None:
            print("mutmut is not installed: pip install -e '.[dev]' (mutmut 3.x)",
                  file=sys.stderr)
            return 2
        exe = Path(found)
    cmd = [str(exe), "run", "--max-children", str(max_children), *names]
    failures = stage_dir / FAILURES
    failures.unlink(missing_ok=True)
    rc = subprocess.run(cmd, cwd=stage_dir, env=mutmut_env(stage_dir)).returncode
    if rc != 0 and failures.exists():
        text = failures.read_text()
        print(f"tests that failed without a mutant ({failures}):\n{text[-4000:]}",
              file=sys.stderr)
    return rc


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's: sfa_rd2h.spec.wire.x_decode__mutmut_3
    file: str  # spec/wire.py
    function: str  # decode, or Class.method
    status: str


@dataclass
class Report:
    files: dict[str, dict[str, int]] = field(default_factory=dict)  # file -> status -> n
    survivors: list[dict[str, Any]] = field(default_factory=list)
    equivalent: list[dict[str, Any]] = field(default_factory=list)
    stale_equivalents: list[dict[str, Any]] = field(default_factory=list)
    detected: int = 0
    undetected: int = 0
    not_run: int = 0
    seconds: float | None = None

    @property
    def score(self) -> float | None:
        """Detected / (detected + undetected), equivalent mutants excluded."""
        total = self.detected + self.undetected
        return None if total == 0 else self.detected / total


def parse_mutant_name(name: str) -> tuple[str, str]:
    """``(file, function)`` of a mutmut mutant name."""
    module, _, mangled = name.rpartition(".")
    parts = module.split(".")
    if parts[0] == PACKAGE:
        parts = parts[1:]
    file = "/".join(parts) + ".py"
    base = mangled.rsplit("__mutmut_", 1)[0]
    if base.startswith("xǁ"):
        cls, _, func = base[2:].partition("ǁ")
        return file, f"{cls}.{func}"
    return file, base[2:] if base.startswith("x_") else base


def staged_targets(stage_dir: Path) -> list[str] | None:
    """The target files of the stage's latest run (None: no run recorded). Results of other
    files may linger in its ``mutants/`` from earlier runs, measured against older tests."""
    try:
        taken = json.loads((stage_dir / STATS_FILES).read_text())
    except (OSError, ValueError):
        return None
    return list(taken["files"] if isinstance(taken, dict) else taken)


def load_mutants(stage_dir: Path, files: Iterable[str] | None = None) -> list[Mutant]:
    """Every mutant mutmut recorded under ``stage_dir/mutants`` (its ``.meta`` files), only
    those of ``files`` when given."""
    wanted = None if files is None else set(files)
    out = []
    for meta in sorted((stage_dir / "mutants" / PACKAGE).rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        for name, code in data.get("exit_code_by_key", {}).items():
            file, function = parse_mutant_name(name)
            if wanted is None or file in wanted:
                out.append(Mutant(name, file, function, _STATUS.get(code, "suspicious")))
    return out


def load_stages(stage_dirs: Sequence[Path]) -> tuple[list[Mutant], dict[str, Path]]:
    """The mutants of each stage's latest run, a file taken from the first stage that ran it;
    and which stage each mutant comes from (its diff is read there)."""
    mutants: list[Mutant] = []
    home: dict[str, Path] = {}
    seen: set[str] = set()
    for stage_dir in stage_dirs:
        files = staged_targets(stage_dir)
        if files is None:
            continue
        files = [f for f in files if f not in seen]
        seen.update(files)
        for m in load_mutants(stage_dir, files):
            mutants.append(m)
            home[m.name] = stage_dir
    return mutants, home


def change_of(diff: str) -> list[str]:
    """The changed lines of a mutant's diff, stripped: what identifies a mutant across runs
    (mutmut's numbers shift when a function changes; the change itself does not)."""
    return [line[0] + line[1:].strip() for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def load_equivalents(path: Path) -> list[dict[str, Any]]:
    """The catalog: ``[{file, function, change, reason}]``; every entry needs a reason."""
    if not path.exists():
        return []
    entries = json.loads(path.read_text())
    for i, e in enumerate(entries):
        missing = [k for k in ("file", "function", "change", "reason") if not e.get(k)]
        if missing:
            raise ValueError(f"{path}: entry {i} lacks {', '.join(missing)}")
    return entries


def build_report(mutants: Sequence[Mutant], equivalents: Sequence[dict[str, Any]],
                 diff_of: Callable[[Mutant], str]) -> Report:
    """Score and survivors; a survivor whose (file, function, change) is in the catalog of
    equivalents is listed as equivalent instead. Catalog entries that match no survivor any
    more are reported as stale (the code changed, or a test now kills them)."""
    report = Report()
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    known = {(e["file"], e["function"], tuple(e["change"])): e for e in equivalents}
    used: set[tuple[str, str, tuple[str, ...]]] = set()
    for m in mutants:
        if m.status in DETECTED:
            counts[m.file][m.status] += 1
            report.detected += 1
            continue
        if m.status not in UNDETECTED:
            counts[m.file][m.status] += 1
            report.not_run += 1
            continue
        diff = diff_of(m)
        key = (m.file, m.function, tuple(change_of(diff)))
        entry = {"mutant": m.name, "file": m.file, "function": m.function,
                 "status": m.status, "change": list(key[2])}
        if key in known:
            used.add(key)
            report.equivalent.append({**entry, "reason": known[key]["reason"]})
            counts[m.file]["equivalent"] += 1
        else:
            counts[m.file][m.status] += 1
            report.undetected += 1
            report.survivors.append(entry)
    report.files = {f: dict(c) for f, c in sorted(counts.items())}
    report.stale_equivalents = [e for k, e in known.items() if k not in used]
    return report


def mutmut_diff(stage_dir: Path) -> Callable[[Mutant], str]:
    """A ``diff_of`` that asks mutmut (run inside the stage, where it reads its config)."""

    def diff_of(m: Mutant) -> str:
        cwd = os.getcwd()
        os.chdir(stage_dir)
        try:
            from mutmut.mutation.diff_apply import get_diff_for_mutant

            return get_diff_for_mutant(m.name, path=Path(PACKAGE) / m.file)
        except Exception as exc:  # noqa: BLE001 - a report must not die on one mutant
            return f"(no diff: {type(exc).__name__}: {exc})"
        finally:
            os.chdir(cwd)

    return diff_of


def format_report(report: Report) -> str:
    lines = []
    score = report.score
    head = "no mutant has been run" if score is None else (
        f"mutation score {score:.1%}: {report.detected} detected, {report.undetected} not "
        f"detected, {len(report.equivalent)} equivalent (excluded)")
    if report.not_run:
        head += f", {report.not_run} not run yet"
    if report.seconds is not None:
        head += f"; this run took {report.seconds / 60:.1f} min"
    lines.append(head)
    lines.append("")
    width = max((len(f) for f in report.files), default=10)
    for file, counts in report.files.items():
        detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        found = sum(n for s, n in counts.items() if s in DETECTED)
        missed = sum(n for s, n in counts.items() if s in UNDETECTED)
        score = f"{found / (found + missed):6.1%}" if found + missed else "     -"
        lines.append(f"  {file:<{width}}  {score}  {detail}")
    by_place: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for s in report.survivors:
        by_place[(s["file"], s["function"])].append(s)
    if by_place:
        lines += ["", "survivors (file, function: mutant, change):"]
        current = None
        for (file, function), items in sorted(by_place.items()):
            if file != current:
                lines.append(f"  {file}")
                current = file
            lines.append(f"    {function}: {len(items)}")
            for s in items:
                lines.append(f"      {s['mutant'].rpartition('.')[2]} ({s['status']})")
                lines += [f"        {c}" for c in s["change"]]
    if report.stale_equivalents:
        lines += ["", f"stale entries in {EQUIVALENTS} (no such survivor any more):"]
        lines += [f"  {e['file']} {e['function']}: {e['change']}"
                  for e in report.stale_equivalents]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command


def add_mutation_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``mutation`` to an argparse sub-command set; the handler is ``cmd_mutation``."""
    p = subparsers.add_parser(
        "mutation", help="mutation testing of the runtime adapters and the codec (mutmut)",
        description="Run mutmut over " + ", ".join(TARGETS) + " with tests selected per "
                    "mutant, then report the score and the survivors by file and function. "
                    "Exit 0 when every mutant run was detected or is a recorded equivalent, "
                    "1 when some survived, 2 when mutmut is missing or failed.")
    p.add_argument("--only", action="append", default=[], metavar="GLOB",
                   help="mutate only target files matching GLOB (repeatable), e.g. "
                        "runtime/tp_group.py")
    p.add_argument("--mutants", action="append", default=[], metavar="GLOB",
                   help="run only the mutants whose mutmut name matches GLOB (repeatable), "
                        "e.g. 'sfa_rd2h.spec.wire.*', leaving the rest of the staged files "
                        "as they are; matching mutants run again even if they have a result")
    p.add_argument("--survivors", action="store_true",
                   help="run only the target files' mutants that were not detected last time "
                        "(after writing tests for them), not the untested ones")
    p.add_argument("--report", action="store_true",
                   help="report the last run's results without running anything")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--max-children", type=int, default=2 * (os.cpu_count() or 1),
                   help="mutants tested in parallel (default: twice the CPU count, so that "
                        "mutants hung in a wait until their timeout leave the CPUs to others)")
    p.add_argument("--fresh", action="store_true",
                   help="forget earlier results and stage everything anew")
    p.add_argument("--stage", action="append", default=[], metavar="DIR",
                   help=f"staging folder (default {STAGE}); with --report repeatable: one "
                        "report over the latest run of each, a file counted from the first "
                        "stage that ran it")
    p.set_defaults(func=cmd_mutation)
    return p


def cmd_mutation(args: argparse.Namespace) -> int:
    root = repo_root()
    stage_dirs = [Path(d) for d in args.stage] or [root / STAGE]
    stage_dir = stage_dirs[0]
    seconds = None
    if not args.report:
        if len(stage_dirs) > 1:
            print("one --stage to run in (several only with --report)", file=sys.stderr)
            return 2
        files = target_files(root, args.only)
        if not files:
            print(f"no target file matches {args.only}; targets: {', '.join(TARGETS)}",
                  file=sys.stderr)
            return 2
        names = list(args.mutants)
        if getattr(args, "survivors", False):
            names += sorted(m.name for m in load_mutants(stage_dir, files)
                            if m.status in UNDETECTED)
            if not names:
                print("no undetected mutant to run again", file=sys.stderr)
                return 0
        stage(root, stage_dir, files, TEST_FILES, args.fresh)
        t0 = time.monotonic()
        rc = run_mutmut(stage_dir, args.max_children, names)
        seconds = time.monotonic() - t0
        if rc != 0:
            print(f"mutmut exited with {rc}", file=sys.stderr)
            return 2
    missing = [d for d in stage_dirs if not (d / "mutants").is_dir()]
    if missing:
        print(f"no results in {missing[0]}: run sfa-rd2h mutation first", file=sys.stderr)
        return 2
    mutants, home = load_stages(stage_dirs)
    diffs = {d: mutmut_diff(d) for d in stage_dirs}
    report = build_report(mutants, load_equivalents(root / EQUIVALENTS),
                          lambda m: diffs[home[m.name]](m))
    report.seconds = seconds
    if args.json:
        print(json.dumps({**asdict(report), "score": report.score}, indent=2))
    else:
        print(format_report(report))
    return 1 if report.survivors else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sfa-rd2h")
    add_mutation_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["mutation", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
