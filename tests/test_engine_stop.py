"""Stopping an engine leaves nothing in /dev/shm, nor its IPC sockets in /tmp.

``vllm serve`` is a process group: the API server leads it, the EngineCore and its workers
talk through multiprocessing shared memory (``psm_*``) and semaphores (``sem.mp-*``), and
multiprocessing's resource tracker removes what a dead process left. The API server exits
first on SIGTERM; an engine stopped by killing the group at that moment left those files in
/dev/shm for good. Its ZMQ IPC sockets are files too, in ``VLLM_RPC_BASE_PATH`` (/tmp
unless set), and a killed engine leaves them. These tests run a real process group of that
shape (a shell leading a Python process that makes real multiprocessing shared memory and
binds a Unix socket where vLLM would) through :meth:`EngineServer.stop`, with no vLLM needed.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from sfa_rd2h.runtime.vllm import launch

# The EngineCore stand-in: makes a shared memory block and a named semaphore the way
# vLLM's message queues and multiprocessing do, says their files, then on SIGTERM either
# shuts down slowly and removes them itself ("slow", as an EngineCore stopping its workers)
# or never acts on SIGTERM at all ("stuck").
STAND_IN = r"""
import multiprocessing, os, signal, socket, sys, time
from multiprocessing import shared_memory

fifo, mode = sys.argv[1], sys.argv[2]
block = shared_memory.SharedMemory(create=True, size=1 << 20)
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore in /dev/shm
names = ["/dev/shm/" + block.name, "/dev/shm/sem." + lock._semlock.name.lstrip("/")]
rpc = socket.socket(socket.AF_UNIX)  # as ZMQ binds ipc://$VLLM_RPC_BASE_PATH/<uuid>
rpc.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core-input"))
names.append(rpc.getsockname())
if mode == "stuck":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by sigwait below
with open(fifo, "w") as out:
    out.write(" ".join(names) + "\n")
if mode == "stuck":
    while True:
        signal.pause()
signal.sigwait({signal.SIGTERM})
time.sleep(1.0)  # the stand-in's slow shutdown: what the stopping side must wait out
block.close()
block.unlink()
del lock  # its finalizer removes the semaphore's file
"""


def _start(tmp_path: Path, mode: str) -> tuple[launch.EngineServer, list[str], Path]:
    """The stand-in's engine, started, with its shared memory files and its socket."""
    script = tmp_path / "engine_core.py"
    script.write_text(STAND_IN)
    fifo = tmp_path / "names"
    os.mkfifo(fifo)
    # The shell leads the group and exits on SIGTERM at once, as vLLM's API server does
    # before its EngineCore has finished.
    cmd = ["sh", "-c", f'"{sys.executable}" "{script}" "{fifo}" {mode} & wait']
    server = launch.EngineServer(name=f"stand-in-{mode}", port=0, cmd=cmd,
                                 env=dict(os.environ), log_path=tmp_path / f"{mode}.log")
    server.start()
    # Readable once the stand-in has written (or died): a FIFO opened without blocking
    # reports no hang-up before a writer has come and gone.
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        ready, _, _ = select.select([fd], [], [], 120.0)
        files = os.read(fd, 4096).decode().split() if ready else []
    finally:
        os.close(fd)
    if len(files) != 3:
        server.stop()
        pytest.fail(f"the stand-in did not say its files; log:\n{server.log_text()}")
    assert all(Path(f).exists() for f in files), files
    return server, files[:2], Path(files[2])


@pytest.mark.parametrize("mode", ["slow", "stuck"])
def test_a_stopped_engine_leaves_no_shared_memory(tmp_path: Path, mode: str) -> None:
    server, files, sock = _start(tmp_path, mode)
    assert server.proc is not None and server.rpc_dir is not None
    assert sock.parent == server.rpc_dir and sock.is_socket()
    pgid = server.proc.pid
    try:
        server.stop(timeout=15.0 if mode == "slow" else 2.0)
    finally:
        launch.unlink_existing(files)  # never leave them behind, whatever failed
    assert launch.group_members(pgid) == []
    assert not server.rpc_dir.exists()  # the socket with it, bound by a process now gone
    assert sorted(server.shared_files) == sorted(files)
    left = [f for f in files if Path(f).exists()]
    assert left == [], f"{mode}: {left} left in /dev/shm; log:\n{server.log_text()}"
    if mode == "slow":
        # It removed its own files: stop() waited for it after the shell had gone.
        assert server.unlinked == []
    else:
        # Killed: stop() removed what it had mapped.
        assert sorted(server.unlinked) == sorted(files)
    server.stop()  # twice is fine
    assert server.unlinked == ([] if mode == "slow" else sorted(files))


def test_an_engine_whose_api_server_died_first_is_still_stopped_gracefully(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server (the group's leader) is killed outright (the OOM killer, a crash);
    its EngineCore does not watch it and runs on. stop() still asks the rest of the group
    to stop, which then removes its own files; and a stop after that leaves the group's
    number alone (once the group is gone, the number may be anyone's). Before, a dead
    leader meant no SIGTERM: stop waited out its timeout, killed the group and left its
    shared memory behind."""
    import signal

    server, files, _ = _start(tmp_path, "slow")
    assert server.proc is not None
    pgid = server.proc.pid
    try:
        os.kill(pgid, signal.SIGKILL)
        server.proc.wait()
        assert [comm for _, comm in server.processes()], "the stand-in runs on, seen"
        server.stop(timeout=15.0)
    finally:
        if launch.group_members(pgid):  # whatever failed, the stand-in does not outlive it
            os.killpg(pgid, signal.SIGKILL)
        launch.unlink_existing(files)
    assert sorted(server.shared_files) == sorted(files)
    assert server.unlinked == []  # it removed them itself, asked by SIGTERM
    assert server.processes() == []

    def never(*args: object) -> list[str]:
        raise AssertionError("a second stop reaped the group's number again")

    monkeypatch.setattr(launch, "reap_group", never)
    server.stop()


def test_a_deployment_stops_every_engine_even_if_one_stop_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    first, first_files, _ = _start(tmp_path / "a", "slow")
    second, second_files, _ = _start(tmp_path / "b", "slow")
    dep = launch.Deployment(tmp_path, launch.EngineOptions(model="m"),
                            servers={"prefill": first, "decode": second})
    real_stop = first.stop

    def failing_stop(timeout: float = 15.0) -> None:
        real_stop(timeout)
        raise RuntimeError("the first engine's stop failed")

    monkeypatch.setattr(first, "stop", failing_stop)
    try:
        with pytest.raises(RuntimeError, match="the first engine's stop failed"):
            dep.close(timeout=30.0)
        assert second.processes() == [] and second.rpc_dir is not None
        assert not second.rpc_dir.exists()
        assert not [f for f in second_files if Path(f).exists()]
    finally:
        second.stop()
        launch.unlink_existing(first_files + second_files)


def test_waiting_works_for_descriptors_past_what_select_takes() -> None:
    """A process with over 1024 files open (a vLLM worker may be one) gets pidfds numbered
    past what ``select`` takes: waiting for an exit, and the host engine's check that its
    peer is alive, still work."""
    import resource
    import subprocess
    import time

    from sfa_rd2h.runtime import processes
    from sfa_rd2h.runtime.engines import host

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1600:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1600, hard), hard))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    fd = os.pidfd_open(child.pid)
    high = os.dup2(fd, 1500)
    try:
        assert not host._exited(high)
        assert not processes.wait_exit([high], time.monotonic() + 0.1)
        assert child.stdin is not None
        child.stdin.close()
        assert processes.wait_exit([high], time.monotonic() + 30.0)
        assert host._exited(high)
    finally:
        os.close(high)
        os.close(fd)
        child.kill()
        child.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_waiting_for_processes_returns_when_they_exit_or_at_the_deadline() -> None:
    import subprocess
    import time

    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert launch.wait_gone([quick.pid], time.monotonic() + 30.0)
        started = time.monotonic()
        assert not launch.wait_gone([slow.pid], started + 0.2)
        assert time.monotonic() - started < 10.0
    finally:
        slow.kill()
        slow.wait()
        quick.wait()


def test_the_ipc_folder_is_made_where_asked_and_never_left_by_a_failed_start(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The folder goes under the caller's ``VLLM_RPC_BASE_PATH`` (else the temporary
    folder); one too deep for a Unix socket's path is refused up front, naming the way out,
    rather than failing inside vLLM; a start whose command cannot run leaves no folder."""
    base = Path(tempfile.mkdtemp(prefix="sfa-t-"))  # short: tmp_path is deep already
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    missing = launch.EngineServer(name="missing", port=0, cmd=[str(tmp_path / "no-such")],
                                  env={**os.environ, "VLLM_RPC_BASE_PATH": str(base)},
                                  log_path=tmp_path / "missing.log")
    with pytest.raises(FileNotFoundError):
        missing.start()
    assert missing.rpc_dir is not None and missing.rpc_dir.parent == base
    assert list(base.iterdir()) == []  # removed again
    deep = base / ("d" * 80)
    deep.mkdir()
    too_deep = launch.EngineServer(name="deep", port=0, cmd=["true"],
                                   env={**os.environ, "VLLM_RPC_BASE_PATH": str(deep)},
                                   log_path=tmp_path / "deep.log")
    with pytest.raises(launch.EngineError, match="too long for a Unix socket path"):
        too_deep.start()
    assert list(deep.iterdir()) == [] and too_deep.proc is None
    once = launch.EngineServer(name="once", port=0, cmd=["true"], env=dict(os.environ),
                               log_path=tmp_path / "once.log")
    once.start()
    try:
        with pytest.raises(RuntimeError, match="start"):
            once.start()
    finally:
        once.stop()
    assert once.rpc_dir is not None and not once.rpc_dir.exists()
