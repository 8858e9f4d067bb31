"""What a newcomer meets first: the CLI's edges, the in-repo protocol reference, diagrams that
say how to read them, and nothing in the repository pointing outside it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sfa_rd2h.model_check import mutants
from sfa_rd2h.model_check.checker import run_check
from sfa_rd2h.runtime.tools import reference, sequence
from sfa_rd2h.runtime.tools.cli import main
from sfa_rd2h.statemachines import render
from sfa_rd2h.statemachines.tables import BY_NAME

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- reference


def test_committed_protocol_reference_is_fresh(capsys):
    assert main(["reference", "--check"]) == 0
    assert "matches" in capsys.readouterr().out


def test_reference_check_detects_a_stale_file(tmp_path, capsys):
    path = tmp_path / "PROTOCOL.md"
    assert main(["reference", "--out", str(path)]) == 0
    assert main(["reference", "--check", "--out", str(path)]) == 0
    path.write_text(path.read_text().replace("### S1\n", "### S1 (edited by hand)\n"))
    assert main(["reference", "--check", "--out", str(path)]) == 1
    assert "stale" in capsys.readouterr().err


def test_reference_lists_what_keeps_each_rule():
    text = reference.generate(REPO / "tests")
    s1 = text[text.index("### S1\n"):text.index("### S2\n")]
    assert "A physical buffer is overwritten only after" in s1  # the catalog's text
    assert "`prefill_slot`: `free --begin_write / take_owner--> writing`" in s1  # a row
    assert "`check_s1_no_overwrite_while_read`" in s1  # the checker's predicate
    assert "`ack_from_any_reader` (known failure 1)" in s1  # a seeded bug
    assert "`tests/test_cores.py::test_prefill_handshakes_once_then_sends_ready`" in s1
    t1 = text[text.index("### T1\n"):text.index("### T2\n")]
    assert "`sfa_rd2h.spec.topology:tp_mapping`" in t1  # the spec function deciding it


def test_reference_finds_rule_comments_in_tests(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "def test_a():  # R5\n    pass\n\n"
        "def test_b():\n    '''Keeps W1 and Q9 (not a rule).'''\n\n"
        "def helper():  # S1: not a test\n    pass\n")
    found = reference.tests_by_rule(tests)
    assert found == {"R5": ["tests/test_x.py::test_a"], "W1": ["tests/test_x.py::test_b"]}


def test_nothing_in_the_repo_points_outside_it():
    """The rules live in spec/PROTOCOL.md; no file may send a reader to ../shared or to
    documents that are not in the repository."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
    offenders = []
    for name in tracked.split():
        path = REPO / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".cfg", ""} or not path.is_file():
            continue
        if name == "tests/test_cli_edges.py":
            continue  # this test names what it forbids
        text = path.read_text(errors="replace")
        # PROTOCOL.md is fine as spec/PROTOCOL.md or as a quoted path component in code
        for pattern in (r"\.\./shared", r"ARCHITECTURE\.md", r'(?<![/"])PROTOCOL\.md'):
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"{name}:{line}: {m.group(0)}")
    assert offenders == []
    assert "spec/PROTOCOL.md" in (REPO / "README.md").read_text()


def test_bench_help_names_no_outside_document(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "ARCHITECTURE" not in capsys.readouterr().out


# --------------------------------------------------------------------------- diagrams


def test_diagrams_teach_how_to_read_them():
    dot = render.dot_source(BY_NAME["decode_layer_read"])
    # guard order where rows share (state, trigger); the unguarded last row reads [else]
    assert '"1. read_completed\\n[result_ok, within_budget]\\n(C4, S6)"' in dot
    assert '"2. read_completed [else]\\n/ record_result\\n(F2, S6, R5)"' in dot
    assert "reject\\n/ record_error\\n(W1, W5, L1, T1)" in dot  # effects and rule IDs
    assert "READ_FAILED sent; destinations of" in dot  # what the state means
    assert "cluster_legend" in dot and "__initial -> received" in dot
    initial = re.search(r"^\treceived \[.*fillcolor=\"(#\w+)\"", dot, re.M)
    failed = re.search(r"^\tfailed \[.*fillcolor=\"(#\w+)\"", dot, re.M)
    assert initial and failed and initial.group(1) != failed.group(1)
    assert initial.group(1) == render.INITIAL_FILL and failed.group(1) == render.FAILURE_FILL


def test_several_self_loops_are_drawn_as_one_listing_every_row():
    dot = render.dot_source(BY_NAME["prefill_slot"])
    loops = re.findall(r"^\tawaiting_replies -> awaiting_replies \[label=\"(.*)\"\]$", dot,
                       re.M)
    assert len(loops) == 1
    assert [t for t in ("1. reply_done", "1. reply_failed", "1. reader_lost")
            if t in loops[0]] == ["1. reply_done", "1. reply_failed", "1. reader_lost"]


def test_sequence_diagram_of_a_trace(tmp_path, capsys):
    traces = tmp_path / "traces"
    sequence.example_traces(traces)
    out = tmp_path / "out"
    assert main(["diagrams", "--sequence", str(traces), "--out", str(out)]) == 0
    dot = (out / "sequence.dot").read_text()
    assert "<svg" in (out / "sequence.svg").read_text()
    for name in ("prefill0 (prefill)", "prefill1 (prefill)", "decode0.0 (decode)"):
        assert f'label="{name}"' in dot  # a lifeline per process
    arrows = re.findall(r'-> \w+ \[label="([A-Z_ ]+(?: L\d)?)"', dot)
    # both Prefill ranks handshake, then publish two layers each, each answered
    assert sorted(arrows) == sorted(["MF_META", "MF_META_ACK"] * 2
                                    + ["READY L0", "READY L1", "READ_DONE L0",
                                       "READ_DONE L1"] * 2)
    assert "received -accept-&gt; reading" in dot  # the triggers a READY fired


def test_sequence_of_a_folder_without_traces_is_refused(tmp_path, capsys):
    assert main(["diagrams", "--sequence", str(tmp_path)]) == 2
    assert "no trace files (*.jsonl) found in" in capsys.readouterr().err


def test_diagram_check_outside_a_checkout_does_not_say_stale(tmp_path, capsys):
    assert main(["diagrams", "--check", "--out", str(tmp_path / "diagrams")]) == 2
    err = capsys.readouterr().err
    assert "no diagrams folder at" in err and "stale" not in err


def test_diagram_check_covers_the_sequence_example(tmp_path, capsys):
    render.write_diagrams(tmp_path, svg=False)
    sequence.write_example(tmp_path, svg=False)
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 0
    example = tmp_path / f"{sequence.EXAMPLE_NAME}.dot"
    example.write_text(example.read_text().replace("READY L1", "READY L9", 1))
    assert main(["diagrams", "--check", "--out", str(tmp_path)]) == 1
    assert sequence.EXAMPLE_NAME in capsys.readouterr().err


# --------------------------------------------------------------------------- CLI edges


def test_unknown_mutant_exits_2_naming_the_valid_ones(capsys):
    assert main(["mutants", "--only", "no_such_bug", "--budget", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown seeded bug(s): no_such_bug" in err
    assert all(b.name in err for b in mutants.BUGS)
    with pytest.raises(KeyError, match="no_such_bug"):
        mutants.run_mutants(1, names=["no_such_bug"])


def test_mutants_list_names_every_bug(capsys):
    assert main(["mutants", "--list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows] == [b.name for b in mutants.BUGS]


@pytest.mark.parametrize("argv", [
    ["check", "--budget", "-1"], ["check", "--budget", "0"], ["check", "--examples", "0"],
    ["mutants", "--budget", "-1"], ["explore", "--max-states", "-5"],
])
def test_nonsense_numbers_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert re.fullmatch(r"sfa-rd2h \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


def test_examples_runs_exactly_that_many_deployments():
    """--examples 30 runs 30 deployments, not the next multiple of the batch size."""
    result = run_check(60, 0, max_examples=30)
    assert result.ok and result.examples == 30
    # hypothesis also starts a few deployments it then discards (data overruns), but not
    # another 20: the last batch was cut to 5 rather than run as a whole batch of 25
    assert 30 <= result.deployed < 50


def test_shrinking_is_announced_to_the_progress_display():
    calls: list[str] = []
    result = run_check(20, 0, prefill_cls=mutants.NotifyBeforeLanded, shrink_seconds=1,
                       on_shrink=lambda: calls.append("shrink"))
    assert not result.ok and calls == ["shrink"]


def test_validate_reports_io_errors_not_divergences(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr()
    assert "no such file or folder" in err.err and "DIVERGENCE" not in err.out + err.err
    assert main(["validate", str(tmp_path)]) == 2
    assert f"no trace files (*.jsonl) found in {tmp_path}" in capsys.readouterr().err


def test_spec_diff_names_a_bad_file_and_refuses_non_snapshots(tmp_path, capsys):
    good = tmp_path / "good.json"
    assert main(["spec", "export", "--out", str(good)]) == 0
    capsys.readouterr()
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert main(["spec", "diff", str(good), str(text)]) == 2
    assert f"{text} is not JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"name": "sfa-rd2h", "version": 1}))
    assert main(["spec", "diff", str(other), str(good)]) == 2
    assert f"{other} is not a spec snapshot" in capsys.readouterr().err
    assert main(["spec", "diff", str(tmp_path / "missing.json"), str(good)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_probe_prints_for_people_and_json_on_request(capsys):
    assert main(["probe", "--role", "local", "--bytes", "2M", "--block-bytes", "512K",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("probe local: host (") and "every byte verified" in out
    assert out.rstrip().endswith("OK")
    assert main(["probe", "--role", "local", "--bytes", "2M", "--repeats", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["role"] == "local" and report["ok"]


def test_probe_decode_without_rendezvous_names_the_flag(capsys):
    assert main(["probe", "--role", "decode"]) == 2
    err = capsys.readouterr().err
    assert "--rendezvous FILE" in err and "info=" not in err


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys):
    from sfa_rd2h.model_check import checker

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checker, "run_check", interrupted)
    import signal

    previous = signal.getsignal(signal.SIGINT)
    try:
        assert main(["check", "--quiet"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == ["interrupted: sfa-rd2h check stopped"]
    assert captured.out == ""


def test_progress_ticker_shows_the_status(capsys):
    from sfa_rd2h.runtime.tools.progress import Ticker

    with Ticker(lambda: (3, "shrinking the counterexample 2s"), total=10, desc="model check",
                unit="s", interval=60) as ticker:
        ticker.redraw()
    err = capsys.readouterr().err
    assert "model check" in err and "shrinking the counterexample 2s" in err and "3/10" in err


@pytest.mark.e2e
def test_mooncake_log_noise_stays_out_of_the_progress_output(tmp_path):
    """Mooncake's glog lines (``E1201 ...``, ``W1201 ...``) go to the ranks' log files, and
    through only with --verbose."""
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda absent")
    cmd = [sys.executable, "-m", "sfa_rd2h.runtime.tools.cli", "demo", "--engine", "mooncake",
           "--p-tp", "1", "--d-tp", "1", "--layers", "2", "--requests", "2"]
    glog = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d", re.M)
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert not glog.search(quiet.stderr), quiet.stderr
    verbose = subprocess.run([*cmd, "--verbose"], capture_output=True, text=True, timeout=120)
    assert verbose.returncode == 0
    assert glog.search(verbose.stderr)  # the noise exists; it was only kept out of the way
