"""Waiting for processes to end without polling: a pidfd turns readable when its process
exits, so a deadline-bounded ``poll`` on pidfds sleeps until then (``poll``, not ``select``:
a process with more than 1024 files open gets pidfds ``select`` cannot take)."""

from __future__ import annotations

import contextlib
import math
import os
import select
import time
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def pidfds(pids: Iterable[int]) -> Iterator[dict[int, int]]:
    """``{pid: pidfd}`` for those of ``pids`` still alive; closed on exit. Opened before
    anything is done to them, a pidfd cannot follow a recycled pid."""
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                fds[pid] = os.pidfd_open(pid)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def wait_exit(fds: Iterable[int], deadline: float) -> bool:
    """Wait until every pidfd of ``fds`` reports its process exited, or ``deadline``
    (``time.monotonic()``) passes; True if all did."""
    pending = set(fds)
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        for fd, _ in poller.poll(max(1, math.ceil(left * 1000))):
            pending.discard(fd)
            poller.unregister(fd)
    return True


def wait_gone(pids: Iterable[int], deadline: float) -> bool:
    """Wait until every one of ``pids`` has exited or ``deadline`` passes; True if all did."""
    with pidfds(pids) as fds:
        return wait_exit(fds.values(), deadline)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used, all its threads (0.0 once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
