"""How the demo's rank processes are started, wired to the parent, traced and stopped."""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sfa_rd2h.runtime.tools.demo.workload import DemoConfig, tensor_bytes

log = logging.getLogger("sfa_rd2h.demo")

@dataclass
class Plan:
    cfg: DemoConfig
    index: dict[str, int]
    tokens: dict[str, int]
    victim: str | None
    p_blocks: int
    d_blocks: int
    proxy_url: str
    base_port: int
    tp_port: int  # rank 0 of the Decode TP group listens here (ZMQ or gloo)
    pool_path: str
    trace_dir: str
    log_dir: str | None = None  # None: children write to our stderr (--verbose)
    # Where Decode posts rendezvous; None: the URL the work item names (metaserver-down
    # points it at a relay that cuts the first connections, F1).
    metaserver_url: str | None = None
    # role ("proxy", "prefill", "decode") -> the address it binds and advertises, and (with
    # --hosts netns) the network namespace it runs in; empty: cfg.host, this namespace.
    addresses: dict[str, str] = field(default_factory=dict)
    netns: dict[str, str] = field(default_factory=dict)

    def address(self, role: str) -> str:
        return self.addresses.get(role, self.cfg.host)

    @property
    def n(self) -> int:
        return len(self.index)

    @property
    def tbytes(self) -> tuple[int, ...]:
        return tensor_bytes(self.cfg.block_tokens, self.cfg.indexer, self.cfg.scale)


class Channel:
    """The child's end of its pipe to the parent; several threads send on it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        with self._lock:
            self.conn.send(msg)


def send_to_live(peers: list[Connection], msg: tuple) -> None:
    """Send ``msg`` to every rank in ``peers`` that is still alive, and forget the ones whose
    pipe is broken: a crash injection may SIGKILL a peer rank at any moment, before or after
    any of the messages sent to it, and the survivors must go on without it."""
    for peer in list(peers):
        try:
            peer.send(msg)
        except OSError:  # BrokenPipeError / ConnectionResetError: that rank is gone
            peers.remove(peer)


def child_logging(name: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transitions").setLevel(logging.WARNING)


def close_quietly(*closers: Any) -> None:
    """Run every closer; a failing one is logged, never masks the error being unwound."""
    for close in closers:
        try:
            close()
        except Exception:  # noqa: BLE001
            log.exception("cleanup step failed")


def make_tracer(plan: Plan, name: str, **info: Any) -> Any:
    from sfa_rd2h.statemachines.trace import Tracer

    return Tracer(Path(plan.trace_dir) / f"{name}.jsonl", name, **info)


def crash(tracer: Any) -> None:
    """A crash injection: SIGKILL this process, with no cleanup - sockets are closed by the
    kernel, engines and threads are not stopped. Only the trace is flushed first (without
    its close marker, ``Tracer.abandon``, as the model checker's crashed Decode leaves it), so
    the validator judges what the process did up to the crash rather than a torn line."""
    tracer.abandon()
    os.kill(os.getpid(), signal.SIGKILL)


def live_threads() -> list[str]:
    """Python threads other than the main one still running: a rank reports them after its
    cleanup, and the parent judges a non-empty list as a thread that did not exit."""
    main = threading.main_thread()
    return sorted(t.name for t in threading.enumerate() if t is not main and t.is_alive())


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the ranks' cleanup (engines, traces)


def _log_to_file(log_dir: str, name: str) -> None:
    """Point this process's fd 2 at ``log_dir/name.log``: third-party libraries (Mooncake's
    glog ``E…``/``W…`` lines) write there from C++, and would otherwise run through the
    parent's progress bar."""
    fd = os.open(os.path.join(log_dir, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def run_child(fn: Any, name: str, plan: Plan, rank: int, conn: Connection, *args: Any) -> None:
    """Entry point of every child: report any failure to the parent, exit non-zero."""
    # A terminal's Ctrl-C reaches the whole process group; the parent alone decides how the
    # run ends (SIGTERM to every rank), so a rank is never interrupted inside its cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Everything imported before the fork is permanent for this process: freezing it keeps
    # full collections from walking it mid-transfer (measured with torch preloaded: 60-180 ms
    # pauses per rank on a 2-core box, the whole p99 round-trip tail).
    gc.freeze()
    role = "prefill" if name.startswith("prefill") else "decode"
    if role in plan.netns:
        from sfa_rd2h.runtime.tools.hosts import enter

        enter(plan.netns[role])  # before any socket or thread: the whole rank is on its host
    if plan.log_dir is not None:
        _log_to_file(plan.log_dir, name)
    child_logging(name)
    # A rank that does not end after "stop" is asked where it is: every thread's stack goes
    # to its log (the file set up above), which a failed run shows.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    chan = Channel(conn)
    try:
        fn(plan, rank, chan, *args)
    except BaseException:  # noqa: BLE001 - the parent prints it and aborts the run
        try:
            chan.send("error", traceback.format_exc())
        finally:
            os._exit(1)


