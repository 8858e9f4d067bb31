"""``sfa-rd2h mutation`` (issue 12): staging, the report's arithmetic and the catalog of
equivalent mutants, without running mutmut (a run takes minutes to an hour)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from sfa_rd2h.runtime.tools import mutation
from sfa_rd2h.runtime.tools.mutation import Mutant, build_report, change_of, parse_mutant_name

REPO = Path(__file__).resolve().parent.parent


def test_mutant_names_map_to_file_and_function() -> None:
    assert parse_mutant_name("sfa_rd2h.spec.wire.x_decode__mutmut_3") == (
        "spec/wire.py", "decode")
    assert parse_mutant_name("sfa_rd2h.runtime.tp_group.xǁTpGroupǁ_remember__mutmut_12") == (
        "runtime/tp_group.py", "TpGroup._remember")
    assert parse_mutant_name("sfa_rd2h.runtime.engines.host.x__copy__mutmut_1") == (
        "runtime/engines/host.py", "_copy")
    assert parse_mutant_name(
        "sfa_rd2h.runtime.tp_group.xǁGlooTpGroupǁ__init____mutmut_7") == (
        "runtime/tp_group.py", "GlooTpGroup.__init__")


def test_targets_are_the_issue_files_minus_the_test_double() -> None:
    files = mutation.target_files(REPO)
    for f in ("runtime/control.py", "runtime/engines/host.py", "runtime/engines/base.py",
              "runtime/metaserver.py", "statemachines/trace.py", "runtime/tp_group.py",
              "spec/wire.py", "spec/layout.py"):
        assert f in files
    assert "runtime/engines/fake_memfabric.py" not in files
    assert mutation.target_files(REPO, ["runtime/tp_group.py"]) == ["runtime/tp_group.py"]
    assert all((REPO / t).is_file() for t in mutation.TEST_FILES)


def _diff(old: str, new: str) -> str:
    return f"--- a\n+++ b\n@@ -1,2 +1,2 @@\n def f():\n-    {old}\n+    {new}\n"


def test_score_excludes_recorded_equivalents_and_lists_survivors_by_place() -> None:
    mutants = [
        Mutant("sfa_rd2h.spec.wire.x_decode__mutmut_1", "spec/wire.py", "decode", "killed"),
        Mutant("sfa_rd2h.spec.wire.x_decode__mutmut_2", "spec/wire.py", "decode", "timeout"),
        Mutant("sfa_rd2h.spec.wire.x_decode__mutmut_3", "spec/wire.py", "decode", "survived"),
        Mutant("sfa_rd2h.spec.wire.x_encode__mutmut_1", "spec/wire.py", "encode", "no tests"),
        Mutant("sfa_rd2h.spec.layout.x_plan__mutmut_1", "spec/layout.py", "plan", "survived"),
        Mutant("sfa_rd2h.spec.layout.x_plan__mutmut_2", "spec/layout.py", "plan",
               "not checked"),
    ]
    diffs = {m.name: _diff("return a", f"return b{i}") for i, m in enumerate(mutants)}
    equivalents = [
        {"file": "spec/layout.py", "function": "plan", "change": ["-return a", "+return b4"],
         "reason": "b4 equals a here"},
        {"file": "spec/wire.py", "function": "gone", "change": ["-x", "+y"],
         "reason": "the code it was about changed"},
    ]
    report = build_report(mutants, equivalents, lambda m: diffs[m.name])
    assert (report.detected, report.undetected, report.not_run) == (2, 2, 1)
    assert report.score == 0.5
    assert [s["mutant"] for s in report.survivors] == [
        "sfa_rd2h.spec.wire.x_decode__mutmut_3", "sfa_rd2h.spec.wire.x_encode__mutmut_1"]
    assert [e["reason"] for e in report.equivalent] == ["b4 equals a here"]
    assert [e["function"] for e in report.stale_equivalents] == ["gone"]
    assert report.files["spec/layout.py"] == {"equivalent": 1, "not checked": 1}
    assert report.files["spec/wire.py"] == {"killed": 1, "timeout": 1, "survived": 1,
                                            "no tests": 1}
    text = mutation.format_report(report)
    assert text.startswith("mutation score 50.0%: 2 detected, 2 not detected, 1 equivalent")
    assert re.search(r"spec/wire.py\n    decode: 1\n      x_decode__mutmut_3 \(survived\)\n"
                     r"        -return a\n        \+return b2", text), text
    assert "stale entries" in text


def test_change_ignores_headers_and_indentation() -> None:
    assert change_of(_diff("if a  >  b:", "if a >= b:")) == ["-if a  >  b:", "+if a >= b:"]


def test_stage_lays_out_the_package_under_its_import_name(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    files = ["runtime/tp_group.py"]
    mutation.stage(REPO, stage, files, mutation.TEST_FILES, fresh=False)
    assert (stage / "sfa_rd2h/runtime/tp_group.py").read_bytes() == (
        REPO / "runtime/tp_group.py").read_bytes()
    assert (stage / "tests/test_tp_group.py").is_file()
    assert not list(stage.rglob("__pycache__"))
    config = (stage / "pyproject.toml").read_text()
    assert config.count("[tool.mutmut]") == 1 and "[tool.pytest.ini_options]" in config
    assert 'only_mutate = ["sfa_rd2h/runtime/tp_group.py"]' in config
    for test in mutation.DESELECTED:  # slow tests kept out of the per-mutant selection
        assert f'"--deselect", "{test}"' in config
        file, _, name = test.partition("::")
        assert f"def {name}(" in (REPO / file).read_text()
    assert 'process_isolation = "forkserver"' in config
    assert (stage / "hooks/sitecustomize.py").is_file()
    assert (stage / "hooks/sfa_rd2h_mutation_plugin.py").is_file()
    env = mutation.mutmut_env(stage)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str((stage / "hooks").resolve()),
                                                        str((stage / "mutants").resolve())]
    # A second staging keeps the times of unchanged files (mutmut re-tests what changed),
    # and brings mutmut's copy of a file it does not mutate up to date.
    copied = stage / "mutants/sfa_rd2h/spec/wire.py"
    copied.parent.mkdir(parents=True)
    copied.write_text("stale")
    before = (stage / "sfa_rd2h/spec/layout.py").stat().st_mtime_ns
    mutation.stage(REPO, stage, files, mutation.TEST_FILES, fresh=False)
    assert (stage / "sfa_rd2h/spec/layout.py").stat().st_mtime_ns == before
    assert copied.read_bytes() == (REPO / "spec/wire.py").read_bytes()
    # mutmut's plain copy of a file that was not a target then (newer than its source, no
    # results) is dropped once the file becomes a target, or mutmut would never mutate it;
    # a target's mutated copy with results is kept.
    mutated = stage / "mutants/sfa_rd2h/runtime/tp_group.py"
    mutated.parent.mkdir(parents=True, exist_ok=True)
    mutated.write_text("mutated")
    mutated.with_name("tp_group.py.meta").write_text("{}")
    mutation.stage(REPO, stage, ["runtime/tp_group.py", "spec/wire.py"],
                   mutation.TEST_FILES, fresh=False)
    assert not copied.exists()
    assert mutated.read_text() == "mutated"
    # a plain copy left by a run without this target (its results kept) goes too
    mutated.write_bytes((REPO / "runtime/tp_group.py").read_bytes())
    mutation.stage(REPO, stage, ["runtime/tp_group.py"], mutation.TEST_FILES, fresh=False)
    assert not mutated.exists() and mutated.with_name("tp_group.py.meta").exists()


def test_stats_are_collected_anew_when_a_target_is_added(tmp_path: Path) -> None:
    """mutmut's stats (which test reaches which function) cover only the files mutated when
    they were taken: a file added to the targets would otherwise get "no tests" throughout."""
    stage = tmp_path / "stage"
    stats = stage / "mutants/mutmut-stats.json"

    def run(files: list[str]) -> bool:
        mutation.stage(REPO, stage, files, mutation.TEST_FILES, fresh=False)
        kept = stats.exists()
        stats.write_text("{}")  # what mutmut leaves after the run
        return kept

    run(["runtime/tp_group.py", "spec/wire.py"])
    assert run(["runtime/tp_group.py", "spec/wire.py"])  # same targets: stats kept
    assert run(["spec/wire.py"])  # a subset: kept (mutmut drops the other file's part)
    assert not run(["spec/wire.py", "spec/layout.py"])  # layout.py has none: taken anew
    assert not run(["runtime/tp_group.py"])
    assert run(["runtime/tp_group.py"])


def test_stats_are_collected_anew_when_a_test_changes(tmp_path: Path) -> None:
    """mutmut's own incremental pass for new tests ignores the configured deselection, so a
    changed test file means a full stats pass; unchanged tests keep the stats."""
    stage = tmp_path / "stage"
    stats = stage / "mutants/mutmut-stats.json"
    mutation.stage(REPO, stage, ["runtime/tp_group.py"], mutation.TEST_FILES, fresh=False)
    stats.write_text("{}")
    mutation.stage(REPO, stage, ["runtime/tp_group.py"], mutation.TEST_FILES, fresh=False)
    assert stats.exists()
    # a test edited in the checkout since: staging copies it and the stats go
    real_root = tmp_path / "repo"
    shutil.copytree(REPO / "tests", real_root / "tests")
    for name in (*mutation.PACKAGE_DIRS, "pyproject.toml"):
        (real_root / name).symlink_to(REPO / name)
    with (real_root / "tests/test_tp_group.py").open("a") as f:
        f.write("\n# edited\n")
    mutation.stage(real_root, stage, ["runtime/tp_group.py"], mutation.TEST_FILES, fresh=False)
    assert not stats.exists()


def test_results_are_read_from_mutmut_meta_files(tmp_path: Path) -> None:
    meta = tmp_path / "mutants/sfa_rd2h/runtime/tp_group.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {
        "sfa_rd2h.runtime.tp_group.x__invalid__mutmut_1": 1,
        "sfa_rd2h.runtime.tp_group.x__invalid__mutmut_2": 0,
        "sfa_rd2h.runtime.tp_group.x__invalid__mutmut_3": 33,
        "sfa_rd2h.runtime.tp_group.x__invalid__mutmut_4": None}}))
    got = {(m.name.rsplit("_", 1)[1], m.status) for m in mutation.load_mutants(tmp_path)}
    assert got == {("1", "killed"), ("2", "survived"), ("3", "no tests"),
                   ("4", "not checked")}


def test_a_report_over_stages_counts_each_file_from_its_latest_run(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Results of files a stage no longer runs linger in its ``mutants/`` (measured against
    older tests): a report takes only the files of each stage's latest run, and a file run
    in two stages from the first one named."""
    def fake_stage(name: str, files: list[str], codes: dict[str, dict[str, int]]) -> Path:
        stage = tmp_path / name
        for file, by_key in codes.items():
            meta = stage / "mutants/sfa_rd2h" / (file + ".meta")
            meta.parent.mkdir(parents=True, exist_ok=True)
            module = "sfa_rd2h." + file[:-3].replace("/", ".")
            meta.write_text(json.dumps({"exit_code_by_key": {
                f"{module}.x_f__mutmut_{k}": c for k, c in by_key.items()}}))
        (stage / mutation.STATS_FILES).write_text(json.dumps({"files": files, "tests": "x"}))
        return stage

    a = fake_stage("a", ["runtime/tp_group.py"], {
        "runtime/tp_group.py": {"1": 1, "2": 1, "3": 1, "4": 36},
        "spec/wire.py": {"1": 0, "2": 0}})  # lingering from an older run of stage a
    b = fake_stage("b", ["spec/wire.py", "runtime/tp_group.py"], {
        "spec/wire.py": {"1": 1, "2": 1, "3": 1},
        "runtime/tp_group.py": {"1": 0}})  # counted from stage a, named first
    mutants, home = mutation.load_stages([a, b])
    assert sorted((m.file, m.status) for m in mutants) == sorted(
        [("runtime/tp_group.py", "killed")] * 3 + [("runtime/tp_group.py", "timeout")]
        + [("spec/wire.py", "killed")] * 3)
    assert {home[m.name] for m in mutants if m.file == "spec/wire.py"} == {b}
    args = argparse.Namespace(report=True, only=[], json=False, max_children=1, fresh=False,
                              stage=[str(a), str(b)])
    assert mutation.cmd_mutation(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("mutation score 100.0%: 7 detected, 0 not detected")
    assert "  runtime/tp_group.py  100.0%  3 killed, 1 timeout" in out
    args.report = False  # a run happens in one stage only
    assert mutation.cmd_mutation(args) == 2
    assert "one --stage to run in" in capsys.readouterr().err


def test_report_without_a_run_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = argparse.Namespace(report=True, only=[], json=False, max_children=1, fresh=False,
                              stage=[str(tmp_path / "nothing")])
    assert mutation.cmd_mutation(args) == 2
    assert "run sfa-rd2h mutation first" in capsys.readouterr().err


def test_every_recorded_equivalent_has_a_reason_and_still_matches_the_source() -> None:
    """The catalog names each equivalent by file, function and change (mutmut's numbers
    shift): the changed-from lines must still be in that file, or the entry is stale."""
    entries = mutation.load_equivalents(REPO / mutation.EQUIVALENTS)
    for e in entries:
        source = [line.strip() for line in (REPO / e["file"]).read_text().splitlines()]
        assert e["file"] in mutation.target_files(REPO), e
        assert len(e["reason"]) > 20, e
        for line in e["change"]:
            if line.startswith("-"):
                assert line[1:] in source, (e["file"], e["function"], line)


def test_undetected_mutants_are_run_again_detected_ones_keep_their_result(
        tmp_path: Path) -> None:
    """A survivor is re-tested on the next run (a test that kills it may have been added);
    mutmut alone keeps every result until the mutated function changes."""
    stage = tmp_path / "stage"
    meta = stage / "mutants/sfa_rd2h/spec/wire.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {"k1": 1, "k2": 0, "k3": 33, "k4": 36},
                                "hash_by_function_name": {"x_f": "abc"}}))
    mutation.stage(REPO, stage, ["spec/wire.py"], mutation.TEST_FILES, fresh=False)
    data = json.loads(meta.read_text())
    assert data["exit_code_by_key"] == {"k1": 1, "k2": None, "k3": None, "k4": 36}
    assert data["hash_by_function_name"] == {"x_f": "abc"}


def test_mutants_option_narrows_the_mutmut_run(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``--mutants GLOB`` hands the patterns to ``mutmut run``, which then tests only the
    matching mutants; without it mutmut gets no names (every untested mutant)."""
    import subprocess

    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(mutation.subprocess, "run", fake_run)
    parser = argparse.ArgumentParser()
    mutation.add_mutation_parser(parser.add_subparsers())
    args = parser.parse_args(["mutation", "--mutants", "sfa_rd2h.spec.wire.*",
                              "--mutants", "sfa_rd2h.spec.layout.x_a*", "--max-children", "1"])
    assert args.mutants == ["sfa_rd2h.spec.wire.*", "sfa_rd2h.spec.layout.x_a*"]
    assert mutation.run_mutmut(tmp_path, 1, args.mutants) == 0
    assert mutation.run_mutmut(tmp_path, 1) == 0
    assert [c[1:] for c in calls] == [
        ["run", "--max-children", "1", "sfa_rd2h.spec.wire.*", "sfa_rd2h.spec.layout.x_a*"],
        ["run", "--max-children", "1"]]


def test_a_failed_unmutated_pass_shows_which_tests_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """mutmut says only "Failed to run clean test": the staged plugin records the failing
    tests of the unmutated passes and the command prints them."""
    import subprocess

    mutation.stage(REPO, tmp_path, ["runtime/tp_group.py"], mutation.TEST_FILES, fresh=False)
    plugin = (tmp_path / "hooks/sfa_rd2h_mutation_plugin.py").read_text()
    hooks: dict[str, object] = {}
    exec(compile(plugin, "plugin", "exec"), hooks)  # the template formats to valid Python
    log = tmp_path / "failures.log"
    monkeypatch.setenv(mutation.FAILURES_ENV, str(log))
    failed = argparse.Namespace(failed=True, nodeid="tests/t.py::test_a", when="call",
                                longreprtext="AssertionError: 1 != 2")
    for under_test in ("stats", "", "sfa_rd2h.spec.wire.x_f__mutmut_1"):
        monkeypatch.setenv("MUTANT_UNDER_TEST", under_test)
        hooks["pytest_runtest_logreport"](failed)  # type: ignore[operator]
    hooks["pytest_runtest_logreport"](  # type: ignore[operator]
        argparse.Namespace(failed=False, nodeid="tests/t.py::test_b", when="call"))
    # unmutated passes only: under a mutant a failure is the point
    assert log.read_text() == "tests/t.py::test_a (call)\nAssertionError: 1 != 2\n\n" * 2

    def fake_run(cmd: list[str], cwd: Path, env: dict[str, str],
                 **kw: object) -> subprocess.CompletedProcess[str]:
        Path(env[mutation.FAILURES_ENV]).write_text("tests/test_x.py::test_y (call)\nboom\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(mutation.subprocess, "run", fake_run)
    assert mutation.run_mutmut(tmp_path, 1) == 1
    err = capsys.readouterr().err
    assert "tests that failed without a mutant" in err
    assert "tests/test_x.py::test_y (call)\nboom" in err


def test_survivors_option_runs_only_the_undetected_mutants_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """After tests are written for the survivors, ``--survivors`` re-runs just those (by
    name), not the file's untested mutants; with none left it runs nothing."""
    import subprocess

    stage = tmp_path / "stage"
    meta = stage / "mutants/sfa_rd2h/runtime/tp_group.py.meta"
    meta.parent.mkdir(parents=True)
    module = "sfa_rd2h.runtime.tp_group"
    meta.write_text(json.dumps({"exit_code_by_key": {
        f"{module}.x_f__mutmut_1": 1, f"{module}.x_f__mutmut_2": 0,
        f"{module}.x_f__mutmut_3": 33, f"{module}.x_f__mutmut_4": None}}))
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(mutation.subprocess, "run", fake_run)
    parser = argparse.ArgumentParser()
    mutation.add_mutation_parser(parser.add_subparsers())
    args = parser.parse_args(["mutation", "--only", "runtime/tp_group.py", "--survivors",
                              "--stage", str(stage), "--max-children", "1"])
    mutation.cmd_mutation(args)
    assert calls[0][-2:] == [f"{module}.x_f__mutmut_2", f"{module}.x_f__mutmut_3"]
    meta.write_text(json.dumps({"exit_code_by_key": {f"{module}.x_f__mutmut_1": 1}}))
    assert mutation.cmd_mutation(args) == 0 and len(calls) == 1
    assert "no undetected mutant to run again" in capsys.readouterr().err
