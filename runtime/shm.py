"""Names of this project's ``/dev/shm`` files, and removing what dead processes left behind.

Every file the runtime creates there carries the id of the process that created it:
``sfa_rd2h.<pid>.<token>.<suffix>`` (the host engine's regions and control block) and
``sfa_rd2h.demo.<pid>.<token>.pool`` (the demo's shared Decode pool). That lets a test
look at exactly what its own run created, on a host where other runs create files of the
same kind, and lets the next start remove what a crashed (SIGKILLed) run could not.

A file is swept only when its creating pid no longer exists and the file belongs to this
user. A pid that exists is never swept, even if it was recycled by an unrelated process:
leaving a stale file is harmless, removing a live one is not. One limit remains: processes
in another pid namespace that share this ``/dev/shm`` (containers with a shared IPC
namespace) look dead from here, so such deployments should give each container its own
``/dev/shm``, as container runtimes do by default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
PREFIX = "sfa_rd2h."
_OWNER = re.compile(r"^sfa_rd2h\.(?:demo\.)?([0-9]+)\.")


def owner_pid(name: str) -> int | None:
    """The pid of the process that created the file ``name``, or None if it is not ours."""
    m = _OWNER.match(name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists here (a zombie still counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def files_of(pids: Iterable[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Our files in ``shm_dir`` created by any of ``pids``, sorted."""
    wanted = set(pids)
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if owner_pid(n) in wanted)


def sweep_dead(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove our files whose creating process is gone; returns the names removed."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    uid = os.getuid()
    removed = []
    for name in sorted(names):
        pid = owner_pid(name)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue  # another user's: not ours to judge (and /dev/shm is sticky)
            os.unlink(path)
        except FileNotFoundError:
            continue  # another start swept it first
        except OSError:
            continue  # cannot remove it; it costs memory, not correctness
        removed.append(name)
    return removed
