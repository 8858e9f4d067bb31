"""``.ci/stress``, the release check under load: its tally of JUnit reports and its load.

The script is run by hand for hours, so what it would get wrong is checked here in seconds:
which test failed how often and with what words, a pytest that crashed without a report
counted as a failure, and the hogs and the /dev/shm churn really running and really gone."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import time
from pathlib import Path

from sfa_rd2h.runtime.processes import wait_gone

ROOT = Path(__file__).resolve().parents[1]


def _stress():
    loader = importlib.machinery.SourceFileLoader("ci_stress", str(ROOT / ".ci" / "stress"))
    spec = importlib.util.spec_from_loader("ci_stress", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_stress"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_flaky[x]" time="0.1">{failure}</testcase>
<testcase classname="tests.test_b.TestGroup" name="test_in_class" time="0.1">
<error message="fixture broke">trace</error></testcase>
</testsuite></testsuites>"""


def test_runs_and_failures_are_tallied_per_module_and_per_test(tmp_path: Path) -> None:
    stress = _stress()
    results = stress.Results()
    for run, failure in enumerate(('<failure message="AssertionError: boom">x</failure>', "")):
        junit = tmp_path / f"{run}.xml"
        junit.write_text(_JUNIT.format(failure=failure))
        results.record(junit, f"run#{run}", 1, 1.0, "1 failed")
    results.record(tmp_path / "missing.xml", "tests/test_c.py#1", 3, 1.0, "INTERNALERROR")
    a, b = results.by_module["tests/test_a.py"], results.by_module["tests/test_b.py"]
    assert (len(a.cases), a.runs, a.failures, a.first) == (2, 4, 1, "AssertionError: boom")
    assert (b.runs, b.failures, b.first) == (2, 2, "fixture broke")
    flaky = results.by_test["tests/test_a.py::test_flaky[x]"]
    assert (flaky.runs, flaky.failures) == (2, 1)
    assert results.by_test["tests/test_b.py::TestGroup::test_in_class"].failures == 2
    crashed = results.by_module["tests/test_c.py#1"]
    assert (crashed.failures, crashed.first) == (1, "rc=3: INTERNALERROR")
    assert results.failures() == 4
    table = results.table()
    assert "| tests/test_a.py " in table and "AssertionError: boom |" in table
    assert "test: tests/test_a.py::test_flaky[x]" in table
    assert "test: tests/test_a.py::test_ok" not in table  # only tests that failed get a row


def test_the_load_runs_until_stopped_and_leaves_nothing() -> None:
    stress = _stress()
    load = stress.Load(2, True, 600)
    try:
        assert load.hogs_alive() == 2
        noise = load.procs[-1]
        prefix = f"sfa_rd2h.{noise.pid}."
        deadline = time.monotonic() + 30
        while not any(n.startswith(prefix) for n in os.listdir("/dev/shm")):
            assert noise.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)  # the churn's first file: nothing to await across processes
    finally:
        load.stop()
    assert load.hogs_alive() == 0 and all(p.poll() is not None for p in load.procs)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert not left, f"the churn's files outlived it: {left}"


def test_a_killed_run_still_reports_the_runs_that_finished(tmp_path: Path) -> None:
    """Hours of runs must survive a kill: SIGTERM after the first module run finished still
    prints the table and writes the JSON, marked as cut short, and exits with the signal."""
    import json
    import signal
    import subprocess

    out = tmp_path / "stress.json"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / ".ci" / "stress"), "--full", "0", "--repeat", "5",
         "--hogs", "0", "--no-shm-noise", "--modules", "test_interop", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # blocks until the script says the first run ended
        lines.append(line)
        if "tests/test_interop.py#1:" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "INTERRUPTED after 1 run(s)" in rest, rest
    assert "| tests/test_interop.py " in rest, rest
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    assert report["modules"]["tests/test_interop.py"]["runs"] > 0
    assert len(report["invocations"]) == 1


def test_a_killed_run_stops_what_the_run_started(tmp_path: Path) -> None:
    """SIGTERM in the middle of a run stops the run's whole process group: a grandchild
    too, as `bash .ci/run`'s pytest is one (it used to run on after the script ended)."""
    import select
    import signal
    import subprocess

    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    driver = _run_driver(f"['bash', '-c', 'sleep 600 & echo $! > {fifo}; wait']", tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", driver])
    grandchild = None
    try:
        # Readable once the run's shell has written (or died): no hang-up before a writer.
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            ready, _, _ = select.select([fd], [], [], 120.0)
            grandchild = int(os.read(fd, 64).decode().strip() or 0) if ready else None
        finally:
            os.close(fd)
        assert grandchild, "the run never started its grandchild"
        pidfd = os.pidfd_open(grandchild)
        try:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=150) == 128 + signal.SIGTERM
            gone, _, _ = select.select([pidfd], [], [], 30.0)  # readable once it exited
            assert gone, f"the run's grandchild {grandchild} outlived the killed script"
        finally:
            os.close(pidfd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if grandchild:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)


def test_a_check_spread_over_sittings_resumes_and_counts_one_commit(tmp_path: Path) -> None:
    """``--resume`` runs only what the earlier JSON lacks, adds to its tallies, and refuses
    a file of another commit (a release check counts one commit's runs)."""
    import json
    import subprocess

    out = tmp_path / "stress.json"
    base = [sys.executable, str(ROOT / ".ci" / "stress"), "--full", "0", "--hogs", "0",
            "--no-shm-noise", "--modules", "test_control_decode_loop"]
    first = subprocess.run([*base, "--repeat", "1", "--json", str(out)], capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    cases = json.loads(out.read_text())["modules"]["tests/test_control_decode_loop.py"]["cases"]
    second = subprocess.run([*base, "--repeat", "2", "--resume", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming" in second.stdout and "1 run(s) already done" in second.stdout
    assert second.stdout.count("tests/test_control_decode_loop.py#") == 1  # only #2 ran
    report = json.loads(out.read_text())
    assert [i["run"] for i in report["invocations"]] == [
        "tests/test_control_decode_loop.py#1", "tests/test_control_decode_loop.py#2"]
    assert report["modules"]["tests/test_control_decode_loop.py"]["runs"] == 2 * cases
    assert len(report["sessions"]) == 2
    # Another commit with the same code (only the README or a record changed) goes on.
    head = report["commit"]
    report["commit"], report["commits"] = "0000000", ["0000000"]
    out.write_text(json.dumps(report))
    third = subprocess.run([*base, "--repeat", "2", "--resume", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "the code of 0000000" in third.stdout
    assert json.loads(out.read_text())["commits"] == ["0000000", head]
    report["code"] = "0" * 16
    out.write_text(json.dumps(report))
    other = subprocess.run([*base, "--repeat", "3", "--resume", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "one commit's runs only" in other.stdout


def test_only_the_readme_and_the_records_are_not_code() -> None:
    stress = _stress()
    assert stress._not_code("README.md") and stress._not_code(".ci/stress-records/a.json")
    assert not stress._not_code("tests/README.md") and not stress._not_code(".ci/stress")
    assert not stress._not_code("README.md.orig") and not stress._not_code("spec/PROTOCOL.md")
    digest = stress.code_digest()
    assert len(digest) == 16 and digest == stress.code_digest()


def test_a_run_cut_short_gets_its_teardown_when_started_with_sigint_ignored(
        tmp_path: Path) -> None:
    """Started in the background by a script, the stress script inherits SIGINT ignored;
    the run it stops must still get the SIGINT and run its teardown (pytest's: stopping
    engines, removing namespaces), not wait out the grace for a SIGKILL."""
    import select
    import signal
    import subprocess

    fifo, teardown = tmp_path / "pid", tmp_path / "teardown"
    os.mkfifo(fifo)
    # The run stands in for pytest: it gets KeyboardInterrupt on SIGINT only if it started
    # with SIGINT at its default (Python leaves an inherited SIG_IGN alone), and it writes
    # the teardown file once the SIGINT came. It blocks SIGINT before saying its pid and
    # takes it with sigwait: signal.pause() missed a SIGINT that arrived just before it
    # (the handler ran after pause had begun) and slept on until the SIGKILL, 4 of ~30
    # runs under the stress script's load.
    run = (
        "import os, signal\n"
        "interruptible = signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        f"open({str(fifo)!r}, 'w').write(str(os.getpid()))\n"
        "signal.sigwait({signal.SIGINT})\n"
        "if interruptible:\n"
        f"    open({str(teardown)!r}, 'w').write('ran')\n")
    driver = _run_driver(f"[sys.executable, '-c', {run!r}]", tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", driver],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            ready, _, _ = select.select([fd], [], [], 120.0)
            started = ready and os.read(fd, 64).decode().strip()
        finally:
            os.close(fd)
        assert started, "the run never started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=150) == 128 + signal.SIGTERM
        assert teardown.exists(), "the run was killed without its SIGINT teardown"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_does_not_leave_the_run_going(tmp_path: Path) -> None:
    """People press twice: a SIGTERM that comes while the script waits out a stopped run's
    grace must not end that wait early and leave the run going on its own (a whole pytest
    run once went on so, its engines after it); the run's SIGKILL still comes."""
    import select
    import signal
    import subprocess

    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    # A run that will not stop for SIGINT (a test stuck in a call that ignores it): it says
    # its pid, then says it once more each time a SIGINT comes, and sleeps on.
    run = (
        "import os, signal, time\n"
        f"out = open({str(fifo)!r}, 'w', buffering=1)\n"
        "signal.signal(signal.SIGINT, lambda *_: out.write('int\\n'))\n"
        "out.write(f'{os.getpid()}\\n')\n"
        "while True:\n"
        "    time.sleep(60)\n")
    driver = _run_driver(f"[sys.executable, '-c', {run!r}]", tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ, "GRACE": "5"})
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    buf = b""

    def next_line() -> str:
        nonlocal buf
        while b"\n" not in buf:
            # Readable once the run has written, or has gone (then read gives b"").
            ready, _, _ = select.select([fd], [], [], 120.0)
            chunk = os.read(fd, 64) if ready else b""
            assert chunk, f"the run said nothing more after {buf!r}"
            buf += chunk
        line, _, buf = buf.partition(b"\n")
        return line.decode()

    try:
        run_pid = int(next_line())
        proc.send_signal(signal.SIGTERM)
        assert next_line() == "int"  # the script is in its grace now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        # The script waited out the grace and SIGKILLed the run before it left.
        assert wait_gone([run_pid], time.monotonic() + 10.0), "the run goes on"
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_driver(cmd: str, tmp_path: Path) -> str:
    """A program that ``_run``s the command list ``cmd`` (Python source) in ``tmp_path`` and
    leaves on SIGTERM as the stress script does."""
    return ("import os, signal, sys\n"
            f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
            "from pathlib import Path\n"
            "from test_stress_script import _stress\n"
            "stress = _stress()\n"
            "signal.signal(signal.SIGTERM, stress._leave)\n"
            "stress.INTERRUPT_GRACE_S = float(os.environ.get('GRACE', stress.INTERRUPT_GRACE_S))\n"
            f"stress._run({cmd}, 'run', stress.Results(), Path({str(tmp_path)!r}),\n"
            f"           dict(os.environ), Path({str(tmp_path / 'log')!r}))\n")
