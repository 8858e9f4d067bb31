"""The demo machinery end to end: a real proxy, real Prefill and Decode rank processes, real
ZMQ sockets on loopback, real bytes through the host engine, gloo agreement for d_tp > 1.

Each run checks what the demo promises - the outcome the configuration predicts, every
destination byte verified, every trace valid - and, independently of the demo's own verdict,
the exact number of bytes moved (T2: main KV once, T3: indexer once per Decode rank), the
terminal state of every request on every Decode rank (read back from the traces), and a clean
shutdown: every child exited 0, no port still bound, no shared-memory file of the run left
behind (only the run's own files are judged: their names carry its processes' pids, so other
processes on the host may create ``sfa_rd2h.*`` files meanwhile)."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from sfa_rd2h.model_check.cluster import pattern
from sfa_rd2h.runtime import shm
from sfa_rd2h.runtime.tools.demo import (
    BYTES_PER_TOKEN,
    DemoConfig,
    DemoConfigError,
    DemoResult,
    Patterns,
    add_demo_parser,
    cmd_demo,
    make_workload,
    n_blocks,
    run_demo,
)
from sfa_rd2h.runtime.tools.demo.process import send_to_live
from sfa_rd2h.statemachines.trace import validate

SMALL = {"layers": 4, "slots": 2, "requests": 6, "block_tokens": 16, "chunk_tokens": 32,
         "max_tokens": 96, "timeout": 90.0, "progress": False}


def test_patterns_are_the_model_checkers() -> None:
    """The demo writes and checks exactly ``model_check.cluster.pattern`` bytes."""
    rng = np.random.default_rng(7)
    for nbytes in (1, 16, 255, 256, 1000):
        pats = Patterns(nbytes)
        for _ in range(50):
            req, layer, tensor = (int(x) for x in rng.integers(0, 300, size=3))
            pos = rng.integers(0, 600, size=5)
            got = pats.blocks(req, layer, pos, tensor)
            want = np.stack([pattern(req, layer, int(p), tensor, nbytes) for p in pos])
            assert np.array_equal(got, want)


def _leaked(result: DemoResult) -> list[str]:
    """/dev/shm files left by the processes of this run (parent and every rank)."""
    assert "parent" in result.pids and len(result.pids) > 1, result.pids
    return shm.files_of(result.pids.values())


def _assert_port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        s.bind(("127.0.0.1", port))  # fails if anything still listens there
        s.listen()


def _terminal_states(trace_dir: Path) -> dict[str, dict[str, str]]:
    """decode trace name -> request -> the final request_status state it reached."""
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(trace_dir.glob("decode*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["k"] == "tr" and rec["m"] == "request_status" and \
                    rec["dst"] in ("succeeded", "failed"):
                out[path.stem][rec["key"]] = rec["dst"]
    return out


def run(tmp_path: Path, **kw: object) -> tuple[DemoResult, DemoConfig, dict]:
    trace_dir = tmp_path / "traces"
    cfg = DemoConfig(**{**SMALL, **kw}, trace_dir=str(trace_dir))  # type: ignore[arg-type]
    t0 = time.monotonic()
    result = run_demo(cfg)
    assert time.monotonic() - t0 < cfg.timeout
    # clean shutdown
    assert len(result.exit_codes) == cfg.p_tp + cfg.d_tp
    assert all(code == 0 for code in result.exit_codes.values()), \
        f"{result.exit_codes}\n{result.summary()}"
    for port in result.ports:
        _assert_port_free(port)
    _assert_port_free(int(result.proxy_url.rsplit(":", 1)[1]))
    assert _leaked(result) == []
    # traces, validated again here rather than trusting the demo's verdict
    traces = sorted(trace_dir.glob("*.jsonl"))
    assert len(traces) == cfg.p_tp + cfg.d_tp
    report = validate(traces)
    assert report.ok, report.summary()
    assert report.transitions > 0 and report.messages > 0
    return result, cfg, _terminal_states(trace_dir)


def expected_bytes(cfg: DemoConfig) -> int:
    """T2/T3: main K/V land once in the shared pool, indexer and scale once per Decode rank."""
    blocks = sum(n_blocks(t, cfg.block_tokens) for t in make_workload(cfg).tokens.values())
    per_token = BYTES_PER_TOKEN[0] + BYTES_PER_TOKEN[1]
    if cfg.indexer:
        per_token += cfg.d_tp * (BYTES_PER_TOKEN[2] + (BYTES_PER_TOKEN[3] if cfg.scale else 0))
    return blocks * cfg.layers * cfg.block_tokens * per_token


@pytest.mark.e2e
@pytest.mark.parametrize(("p_tp", "d_tp", "indexer", "scale"), [
    (1, 1, True, True),
    (2, 1, False, False),
    (4, 1, True, False),
    (4, 2, True, True),
])
def test_topologies_move_every_byte(tmp_path: Path, p_tp: int, d_tp: int, indexer: bool,
                                    scale: bool) -> None:
    result, cfg, states = run(tmp_path, p_tp=p_tp, d_tp=d_tp, indexer=indexer, scale=scale)
    assert result.ok, result.summary()
    assert (result.requests_ok, result.requests_failed) == (cfg.requests, 0)
    assert result.verified and result.trace_valid and result.expectation_met
    assert result.bytes == expected_bytes(cfg)
    assert result.prefill_gate_errors == 0
    assert result.rtt_p50_ms is not None and 0 < result.rtt_p50_ms <= result.rtt_p99_ms
    ids = set(make_workload(cfg).index)
    assert set(states) == {f"decode{d}" for d in range(d_tp)}
    for rank, got in states.items():
        assert got == dict.fromkeys(ids, "succeeded"), rank


@pytest.mark.e2e
def test_gloo_tp_group_agrees_like_the_zmq_one(tmp_path: Path) -> None:
    """--tp-group gloo: the torch.distributed group vLLM provides, on loopback."""
    result, cfg, states = run(tmp_path, p_tp=2, d_tp=2, tp_group="gloo")
    assert result.ok, result.summary()
    assert result.topology["tp_group"] == "gloo"
    assert result.requests_ok == cfg.requests and result.bytes == expected_bytes(cfg)
    assert all(set(got.values()) == {"succeeded"} for got in states.values())


@pytest.mark.e2e
def test_shm_mode_prefill_allocates_through_the_engine(tmp_path: Path) -> None:
    """A shm-mode host engine serves only memory it allocated: Prefill's caches come from
    the engine instead of torch, and everything still moves and verifies."""
    result, cfg, _ = run(tmp_path, p_tp=2, d_tp=2, host_mode="shm")
    assert result.ok, result.summary()
    assert result.topology["host_mode"] == "shm"
    assert result.verified and result.bytes == expected_bytes(cfg)


@pytest.mark.e2e
def test_read_failure_fails_exactly_the_victims_step(tmp_path: Path) -> None:
    result, cfg, states = run(tmp_path, p_tp=4, d_tp=2, inject="read-failure")
    work = make_workload(cfg)
    victim_job = work.victim.rsplit("-", 1)[0]  # type: ignore[union-attr]
    list_ids = sorted(ext for ext in work.index if ext.startswith(victim_job + "-"))
    assert len(list_ids) == 3  # the prompt list (C3) holding the victim
    assert result.ok, result.summary()
    assert result.failed_requests == list_ids
    assert result.requests_ok == cfg.requests - len(list_ids)
    assert result.prefill_gate_errors >= 1  # S4: Prefill saw the READ_FAILED
    assert result.verified  # every request that succeeded is byte-exact
    for rank, got in states.items():  # R2: failed on every rank, not only on rank 0
        assert {k for k, v in got.items() if v == "failed"} == set(list_ids), rank
        assert len(got) == cfg.requests


@pytest.mark.e2e
def test_layout_mismatch_fails_every_request_cleanly(tmp_path: Path) -> None:
    result, cfg, states = run(tmp_path, p_tp=2, d_tp=1, inject="layout-mismatch")
    assert result.ok, result.summary()
    assert (result.requests_ok, result.requests_failed) == (0, cfg.requests)
    assert result.prefill_gate_errors >= 1
    assert states["decode0"] == dict.fromkeys(make_workload(cfg).index, "failed")


@pytest.mark.e2e
def test_stale_kv_is_caught_by_the_byte_verification(tmp_path: Path) -> None:
    """The negative control of every byte check above: data published before it was
    written (known failure 4) passes the protocol, so only verification can see it."""
    result, cfg, states = run(tmp_path, p_tp=2, d_tp=2, inject="stale-kv")
    assert result.ok, result.summary()  # the mismatch is exactly the predicted one ...
    assert not result.verified  # ... and verification did report it
    assert result.requests_ok == cfg.requests
    for d in range(cfg.d_tp):
        assert result.processes[f"decode{d}"]["n_mismatches"] > 0
    assert all(set(got.values()) == {"succeeded"} for got in states.values())


@pytest.mark.e2e
def test_overall_timeout_kills_everything_and_says_what_was_stuck(tmp_path: Path) -> None:
    t0 = time.monotonic()
    # Hundreds of MB over 16 layers: far more than half a second's work anywhere.
    cfg = DemoConfig(p_tp=2, d_tp=2, layers=16, max_tokens=4096, timeout=0.5, progress=False)
    result = run_demo(cfg)
    assert time.monotonic() - t0 < 15.0
    assert not result.ok
    assert any("timeout after 0.5s" in p for p in result.problems), result.problems
    assert any("requests never finished" in p for p in result.problems)
    # The traces of a stopped run may be consistent as far as they go; they are still not
    # the traces of a valid run, and --json must not say so.
    assert not result.trace_valid and result.trace_report.startswith("incomplete")
    # A run stopped this early has no duration to report, and never a negative one.
    moved = next(line for line in result.summary().splitlines() if "bytes moved" in line)
    if result.seconds is None:
        assert "no duration" in moved, moved
    else:
        assert result.seconds >= 0 and f"in {result.seconds:.3f}s" in moved, moved
    assert all(code is not None for code in result.exit_codes.values())  # none left running
    for port in result.ports:
        _assert_port_free(port)
    assert _leaked(result) == []


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["demo", *argv])


def test_invalid_topology_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture) -> None:
    assert cmd_demo(_cli(["--p-tp", "2", "--d-tp", "4", "--quiet"])) == 2
    assert "T1: p_tp=2 is smaller than d_tp=4" in capsys.readouterr().err
    assert cmd_demo(_cli(["--kv-port", "65535", "--d-tp", "2", "--quiet"])) == 2
    assert "P2: highest Decode TP port 65536" in capsys.readouterr().err


def test_decode_port_in_use_is_reported_within_a_second(
        capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        assert cmd_demo(_cli(["--kv-port", str(port), "--d-tp", "1", "--p-tp", "1",
                              "--quiet"])) == 2
        assert time.monotonic() - t0 < 1.0
    assert f"P1: Decode rank 0 port 127.0.0.1:{port} is not free" in capsys.readouterr().err


def test_the_demo_chooses_ports_the_kernel_never_hands_out_by_itself() -> None:  # P1
    """The ranks bind the ports the parent chose a moment later; a port from the kernel's
    ephemeral range can meanwhile become another connection's source port (a Decode rank's
    BindError in a loaded demo loop). Spans come from below that range, every port free."""
    from sfa_rd2h.runtime.tools.demo import run as demo_run

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for n in (1, 2, 4):
        base = demo_run._free_span("127.0.0.1", n)
        assert 10000 <= base and base + n - 1 < low, (base, n, low)
        for port in range(base, base + n):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # still free: nothing holds it after the probe
    taken = socket.socket()  # a span whose first port is in use is never returned
    try:
        taken.bind(("127.0.0.1", demo_run._free_span("127.0.0.1", 1)))
        held = taken.getsockname()[1]
        assert all(demo_run._free_span("127.0.0.1", 1) != held for _ in range(200))
    finally:
        taken.close()


_NOISE = r"""
import os, select, sys
# Another run on the same host: it keeps creating files named like ours, under its own pid.
n = 0
while True:
    n += 1
    open(f"/dev/shm/sfa_rd2h.{os.getpid()}.0badc0de.{n}", "w").close()
    if n == 1:
        print("started", flush=True)
    if select.select([sys.stdin], [], [], 0.02)[0]:
        break  # stdin closed: the test is done with us
print(n, flush=True)
"""


def _dead_pid() -> int:
    """A pid that existed a moment ago and no longer does."""
    import subprocess

    # Popen.wait, not os.waitpid: a Popen dropped while its child runs is reaped by
    # whichever thread starts the next subprocess (subprocess._cleanup), and a bare
    # waitpid then fails with ECHILD
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: the pid is free now
    pid = child.pid
    assert not shm.pid_alive(pid)
    return pid


@pytest.mark.e2e
def test_leak_check_sees_only_this_run_and_a_start_sweeps_dead_runs(tmp_path: Path) -> None:
    """Another process creates ``sfa_rd2h.*`` files in /dev/shm during the run; the run's
    own leak check is not fooled by them, and the run's start removes what a crashed
    (SIGKILLed) run left behind, but never a live process's files."""
    import subprocess
    import sys

    dead = _dead_pid()
    crashed = [f"sfa_rd2h.{dead}.00c0ffee.ctl", f"sfa_rd2h.demo.{dead}.00c0ffee.pool"]
    shm.sweep_dead()  # anything older goes now, so what this run's start sweeps is ours
    for name in crashed:
        Path("/dev/shm", name).write_bytes(b"left by a crash")
    noise = subprocess.Popen([sys.executable, "-c", _NOISE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert noise.stdout is not None and noise.stdout.readline() == "started\n"
        result, _, _ = run(tmp_path, p_tp=2, d_tp=2)  # asserts nothing of this run leaked
        assert result.ok, result.summary()
        # Swept at the start (by this run, or by another run on the host that started first).
        assert not any(Path("/dev/shm", name).exists() for name in crashed)
        live = shm.files_of([noise.pid])
        assert noise.stdin is not None
        noise.stdin.close()
        created = int(noise.stdout.readline())
        assert noise.wait(30) == 0
        assert created > 1  # it kept creating files while the demo ran ...
        assert live and set(live) <= set(shm.files_of([noise.pid]))  # ... none was swept
    finally:
        if noise.poll() is None:
            noise.kill()
            noise.wait()
        for name in shm.files_of([noise.pid, dead]):
            Path("/dev/shm", name).unlink(missing_ok=True)


def _hold_pipe(conn: object) -> None:
    """A rank that holds its end of a pipe and never reads it (killed by the test)."""
    import signal

    signal.pause()


def test_a_send_to_a_killed_rank_drops_it_and_reaches_the_others() -> None:
    """A crash injection may SIGKILL a rank after the last message sent to it, or between
    two: every rank-to-rank send of the demo goes through ``send_to_live``, which forgets a
    dead peer instead of failing the survivor (kill-prefill's BrokenPipeError at "end")."""
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("spawn")
    (dead_r, dead_w), (live_r, live_w) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
    victim = ctx.Process(target=_hold_pipe, args=(dead_r,), daemon=True)
    victim.start()
    dead_r.close()  # from now on only the victim holds the reading end, as a rank does
    peers = [dead_w, live_w]
    send_to_live(peers, ("step", [0]))  # both alive: both get it
    assert peers == [dead_w, live_w]
    victim.kill()
    victim.join(30)
    assert victim.exitcode == -signal.SIGKILL
    send_to_live(peers, ("step", [1]))
    send_to_live(peers, ("end",))
    assert peers == [live_w]
    assert [live_r.recv() for _ in range(3)] == [("step", [0]), ("step", [1]), ("end",)]


def _await_progress_bar(proc: subprocess.Popen, within: float = 60.0) -> bytes:
    """What a ``demo`` subprocess wrote to stderr up to its progress bar: every rank is up."""
    assert proc.stderr is not None
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + within
        while b"requests" not in seen:
            assert sel.select(max(0.0, deadline - time.monotonic())), seen
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, f"demo exited early ({proc.wait(30)}): {seen!r}"
            seen += chunk
    return seen


def _group_pids(pgid: int) -> set[int]:
    """Every process of a process group (what a terminal's Ctrl-C reaches)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(b")") + 2:].split()[2]) == pgid:
            pids.add(int(entry))
    return pids


@pytest.mark.e2e
def test_ctrl_c_stops_the_demo_with_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal sends it, pressed four times while
    the run moves KV and shuts down: one line, exit 130, no rank left, no /dev/shm file."""
    import signal
    import subprocess
    import sys

    # 200 layers on one slot: every layer waits for the previous one's reply, so the run
    # lasts seconds while using little memory.
    cmd = [sys.executable, "-m", "sfa_rd2h.runtime.tools.cli", "demo", "--p-tp", "2",
           "--d-tp", "2", "--layers", "200", "--slots", "1", "--requests", "2",
           "--timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        seen = _await_progress_bar(proc)
        members = _group_pids(proc.pid)
        assert len(members) >= 5, members  # parent, fork server, four ranks
        for _ in range(4):
            os.killpg(proc.pid, signal.SIGINT)
            try:  # paces the presses like a person, and returns early once it has ended
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = (seen + err).decode(errors="replace")
    lines = [seg.strip() for line in text.split("\n") for seg in [line.split("\r")[-1]]]
    lines = [x for x in lines if x and not x.startswith("requests")]
    assert proc.returncode == 130, text
    assert len(lines) == 1 and lines[0].startswith("interrupted: stopped 4 rank process(es)"), \
        repr(text)
    assert "nothing left in /dev/shm" in lines[0]
    assert out == b""
    assert shm.files_of(members) == []
    assert _all_exit(members - {proc.pid}, within=20.0)  # fork server and ranks alike


def _all_exit(pids: set[int], within: float) -> bool:
    """Await the exit of processes that are not our children (a pidfd becomes readable
    when its process ends, reaped or not)."""
    import select

    deadline = time.monotonic() + within
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone already
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return False
        finally:
            os.close(fd)
    return True


def test_sweep_removes_only_dead_processes_files_of_this_user(tmp_path: Path) -> None:
    dead = _dead_pid()
    names = {
        "dead": f"sfa_rd2h.{dead}.0a0b.1",
        "dead_pool": f"sfa_rd2h.demo.{dead}.0a0b.pool",
        "live": f"sfa_rd2h.{os.getpid()}.0a0b.ctl",
        "foreign_user": f"sfa_rd2h.{dead}.0c0d.ctl",
        "not_ours": f"other.{dead}.0a0b.1",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    other_uid = 65534 if os.getuid() != 65534 else 65533
    if os.getuid() == 0:
        os.chown(tmp_path / names["foreign_user"], other_uid, -1)
        keep_foreign = True
    else:
        keep_foreign = False  # cannot give a file away: it is ours, and dead, so it goes
    removed = shm.sweep_dead(str(tmp_path))
    gone = {names["dead"], names["dead_pool"]} | (set() if keep_foreign
                                                    else {names["foreign_user"]})
    assert set(removed) == gone
    assert set(os.listdir(tmp_path)) == set(names.values()) - gone
    assert shm.files_of([os.getpid()], str(tmp_path)) == [names["live"]]
    assert shm.owner_pid(names["dead_pool"]) == dead and shm.owner_pid("sfa_rd2h.x") is None


def test_the_tp_group_port_is_never_one_of_decodes(monkeypatch) -> None:
    """P1: Decode's ports are free until its ranks bind them, so a free-port draw for the
    TP group could return one of them (rank 0's TP socket and another rank's KV socket on
    one port: a run failing on "address in use"); such a draw is thrown back."""
    from sfa_rd2h.runtime import ports
    from sfa_rd2h.runtime.tools.demo import run as demo_run

    draws = iter([20001, 20003, 20004, 20002])
    monkeypatch.setattr(ports, "free_span", lambda host, n: next(draws))
    assert demo_run._free_port_outside("127.0.0.1", range(20000, 20004)) == 20004
    monkeypatch.setattr(ports, "free_span", lambda host, n: 20001)
    with pytest.raises(DemoConfigError, match="no free port outside 20000-20003"):
        demo_run._free_port_outside("127.0.0.1", range(20000, 20004), attempts=3)


def test_fork_server_preloads_torch_only_for_a_gloo_group(monkeypatch) -> None:
    """The default demo never imports torch (it may not be installed); a gloo TP group
    preloads it where it is installed, and is refused up front where it is not."""
    import importlib.util

    from sfa_rd2h.runtime.tools.demo import run as demo_run

    assert not any(m.startswith("torch") for m in demo_run._preload(DemoConfig()))
    assert "torch.distributed" in demo_run._preload(DemoConfig(tp_group="gloo"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    assert not any(m.startswith("torch") for m in demo_run._preload(DemoConfig(tp_group="gloo")))
    with pytest.raises(DemoConfigError, match="--tp-group gloo needs torch"):
        DemoConfig(tp_group="gloo").check()


@pytest.mark.e2e
@pytest.mark.parametrize("exiting", [False, True], ids=["library", "command-line"])
def test_an_interrupted_demo_gives_the_caller_its_signal_handlers_back(
        tmp_path: Path, exiting: bool) -> None:
    """A real SIGINT stops an in-process run (what a test or another program does); its
    caller gets back its own SIGINT and SIGTERM handlers. The command line alone
    (``exiting``) keeps both ignored, as it exits next: left ignored in a process that goes
    on, they were inherited by everything it started later (a pytest run that could no
    longer be stopped, vLLM engines that outlived it)."""
    import signal
    import threading

    def mine(signum: int, frame: object) -> None:
        raise AssertionError(f"the caller's handler got signal {signum}")

    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}

    traces = tmp_path / "traces"
    cfg = DemoConfig(**{**SMALL, "p_tp": 2, "d_tp": 2, "layers": 200, "slots": 1,
                        "requests": 2, "trace_dir": str(traces)})  # type: ignore[arg-type]

    def press_once_running() -> None:
        # Once every rank has begun its trace (nothing announces it to another thread:
        # this polls), a press as a terminal sends it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and \
                len(list(traces.glob("*.jsonl"))) < cfg.p_tp + cfg.d_tp:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_once_running, daemon=True)
    try:
        presser.start()
        result = run_demo(cfg, exiting=exiting)
        presser.join(60)
        assert result.interrupted and result.stop_signal == signal.SIGINT, result.summary()
        after = {s: signal.getsignal(s) for s in previous}
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    expected = signal.SIG_IGN if exiting else mine
    assert after == {signal.SIGINT: expected, signal.SIGTERM: expected}
    assert _leaked(result) == []


@pytest.mark.e2e
def test_a_press_while_a_rank_is_starting_stops_that_rank_too(monkeypatch) -> None:
    """SIGINT lands just after a rank's process is forked, before the parent has recorded
    it: the run still stops that rank, as it stops every other (before, the press unwound
    past the record and the rank ran on, unknown to the cleanup)."""
    import multiprocessing.process
    import signal

    started: list[int] = []
    real_start = multiprocessing.process.BaseProcess.start

    def start_then_press(self: multiprocessing.process.BaseProcess) -> None:
        real_start(self)
        started.append(self.pid)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled here, in the main thread

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_press)
    result = run_demo(DemoConfig(**SMALL))  # type: ignore[arg-type]
    assert result.interrupted and result.stop_signal == signal.SIGINT, result.summary()
    assert len(started) == 1, f"ranks started after the press: {started}"
    assert started[0] in result.pids.values(), (started, result.pids)
    assert _all_exit(set(started), 10.0), f"rank {started[0]} still runs"
    assert _leaked(result) == []
