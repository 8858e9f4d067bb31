"""Test hosts on one machine: a Linux network namespace per host, joined by a bridge.

Production P/D puts Prefill, Decode and the proxy on different machines; on one machine a
network namespace per "host" gives each its own network stack - its own loopback, its own
address, no loopback shortcut to the others. ``up`` makes a set of them for one deployment
(a *lab*): a hub namespace holding a bridge, and per host a namespace whose ``eth0`` is one
end of a veth pair whose other end sits on the bridge. Every address lives on those links
only, inside namespaces the lab made, and goes with them: nothing is routed to the machine's
own interfaces. ``cut``/``restore`` take a host's link down and up (``tc netem`` is not
available, so delay cannot be injected; a cut can). ``down`` kills every process still in the
lab's namespaces and deletes them, which removes their links too.

Running a command "on host H" is ``ip netns exec <H's namespace> CMD`` (``Lab.command``,
``sfa-rd2h hosts run``). Needs root and iproute2 (``ip``).

CLI: ``sfa-rd2h hosts up prefill decode proxy``, ``hosts run decode -- CMD``,
``hosts cut prefill``, ``hosts restore prefill``, ``hosts list``, ``hosts down``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sfa_rd2h.runtime.processes import pidfds, wait_exit

T = TypeVar("T")

DEFAULT_LAB = "sfa"
DEFAULT_SUBNET = "10.203.0.0/24"
# Namespace names: "<lab>-<host>"; the hub is "<lab>-hub". Kept short: a veth's name is
# at most 15 bytes, and its peer on the bridge is named after the host.
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_STATE_DIR = Path(os.environ.get("SFA_RD2H_HOSTS_DIR", "/run/sfa-rd2h-hosts"))
_KILL_WAIT_S = 5.0


class HostsError(RuntimeError):
    """A lab could not be made, used or removed; the message says which step and why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise HostsError("`ip` not found: install Debian's iproute2") from None
    if check and out.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None where they can (root and iproute2)."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"sfaprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str  # on eth0, the host's only link
    dev: str = "eth0"
    bridge_port: str = ""  # the veth end on the hub's bridge (cut/restore act on it)

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "netns": self.netns, "address": self.address,
                "dev": self.dev, "bridge_port": self.bridge_port}


class Lab:
    """One deployment's hosts. Made by ``Lab.up``, found again by ``Lab.load``, removed by
    ``down`` (also as a context manager, so a failing test still removes it)."""

    def __init__(self, name: str, hosts: dict[str, Host], subnet: str) -> None:
        self.name, self.hosts, self.subnet = name, hosts, subnet

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    def __getitem__(self, host: str) -> Host:
        try:
            return self.hosts[host]
        except KeyError:
            raise HostsError(f"lab {self.name!r} has no host {host!r} "
                             f"(hosts: {', '.join(self.hosts)})") from None

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -------------------------------------------------------------- making and removing

    @classmethod
    def up(cls, hosts: Sequence[str], name: str = DEFAULT_LAB,
           subnet: str = DEFAULT_SUBNET) -> Lab:
        for n in (name, *hosts):
            if not _NAME.match(n) or n == "hub":
                raise HostsError(f"name {n!r}: 1-8 lowercase letters and digits, starting "
                                 f"with a letter, and not 'hub'")
        if len(set(hosts)) != len(hosts) or not hosts:
            raise HostsError(f"host names must be given and distinct: {list(hosts)}")
        net = ipaddress.ip_network(subnet)
        addresses = list(net.hosts())
        if len(addresses) < len(hosts):
            raise HostsError(f"subnet {subnet} has room for {len(addresses)} hosts, "
                             f"not {len(hosts)}")
        existing = set(list_namespaces())
        clash = sorted(ns for ns in existing if ns.startswith(f"{name}-"))
        if clash:
            raise HostsError(f"lab {name!r} exists already ({', '.join(clash)}): "
                             f"`sfa-rd2h hosts down --lab {name}` first")
        lab = cls(name, {}, subnet)
        try:
            _ip("netns", "add", lab.hub)
            _ip("-n", lab.hub, "link", "set", "lo", "up")
            _ip("-n", lab.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", lab.hub, "link", "set", "br0", "up")
            for i, host in enumerate(hosts):
                ns = f"{name}-{host}"
                port = f"p-{host}"
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                    "netns", lab.hub)
                _ip("-n", lab.hub, "link", "set", port, "master", "br0")
                _ip("-n", lab.hub, "link", "set", port, "up")
                addr = str(addresses[i])
                _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                lab.hosts[host] = Host(host, ns, addr, "eth0", port)
            lab._save()
        except BaseException:
            lab.down()
            raise
        return lab

    def down(self) -> list[str]:
        """Kill what still runs in the lab's namespaces, delete them; returns what it
        removed. Safe to call again, and on a lab that was only partly made."""
        # Names hold no "-", so "<lab>-" prefixes exactly this lab's namespaces, the hub's
        # and those of hosts a failed ``up`` made before it was recorded.
        prefix = f"{self.name}-"
        removed = [ns for ns in list_namespaces() if ns.startswith(prefix)]
        problems: list[str] = []
        for ns in removed:
            try:  # one namespace that cannot be cleared must not keep the others
                _kill_all(ns)
                _ip("netns", "delete", ns, check=False)
            except (HostsError, subprocess.SubprocessError) as exc:
                problems.append(f"{ns}: {exc}")
        left = [ns for ns in list_namespaces() if ns.startswith(prefix)]
        if left or problems:
            # The state file stays, naming the lab for a later ``down``.
            raise HostsError(f"lab {self.name} not wholly removed (left: {left}): "
                             + "; ".join(problems))
        self._state_file().unlink(missing_ok=True)
        return removed

    # -------------------------------------------------------------- using

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        return ["ip", "netns", "exec", self[host].netns, *argv]

    def run(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kw)

    def popen(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kw)

    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the bridge: its packets go nowhere until restored."""
        _ip("-n", self.hub, "link", "set", self[host].bridge_port, "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", self[host].bridge_port, "up")

    def pids(self) -> dict[str, list[int]]:
        """Processes running in each of the lab's namespaces."""
        return {h.name: _pids(h.netns) for h in self.hosts.values()}

    def to_json(self) -> dict[str, Any]:
        return {"lab": self.name, "subnet": self.subnet, "hub": self.hub,
                "hosts": {n: h.to_json() for n, h in self.hosts.items()}}

    # -------------------------------------------------------------- state

    def _state_file(self) -> Path:
        return _STATE_DIR / f"{self.name}.json"

    def _save(self) -> None:
        _STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, name: str = DEFAULT_LAB) -> Lab:
        path = _STATE_DIR / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise HostsError(f"no lab {name!r} is up (`sfa-rd2h hosts up ...` makes one)") \
                from None
        hosts = {n: Host(**h) for n, h in data["hosts"].items()}
        missing = [h.netns for h in hosts.values() if h.netns not in list_namespaces()]
        if missing:
            raise HostsError(f"lab {name!r} is broken: namespaces {missing} are gone "
                             f"(`sfa-rd2h hosts down --lab {name}` cleans up)")
        return cls(name, hosts, data["subnet"])


_CLONE_NEWNET = 0x40000000


def enter(netns: str) -> None:
    """Move the calling thread into ``netns`` (``ip netns`` names it). A network namespace
    belongs to a thread: sockets it opens and threads it starts afterwards are there, the
    process's other threads stay where they were. A process that calls this first thing,
    before it has threads, is wholly on that host."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise HostsError(f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(netns: str | None, fn: Callable[[], T]) -> T:
    """``fn()`` run on a short-lived thread inside ``netns`` (here where None): what it binds
    is bound there, and threads it starts stay there (e.g. a server's accept loop)."""
    if netns is None:
        return fn()
    out: list[Any] = []

    def body() -> None:
        try:
            enter(netns)
            out.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out.append((False, exc))

    t = threading.Thread(target=body, name=f"in-{netns}")
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _kill_all(netns: str) -> None:
    """SIGKILL every process in ``netns`` and wait for each to exit (a pidfd turns readable
    when its process ends), until none is left there; bounded by ``_KILL_WAIT_S``."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while pids := _pids(netns):
        with pidfds(pids) as fds:
            for pid in fds:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            wait_exit(fds.values(), deadline)
        if time.monotonic() >= deadline and _pids(netns):
            raise HostsError(f"processes {_pids(netns)} in {netns} survived SIGKILL for "
                             f"{_KILL_WAIT_S:g}s")


# ============================================================================ CLI


def add_hosts_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("hosts", help="test hosts: a network namespace per host "
                                            "(root)", description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", default=DEFAULT_LAB, help=f"the lab's name ({DEFAULT_LAB})")
    sub = p.add_subparsers(dest="hosts_command", required=True)
    up = sub.add_parser("up", help="make the hosts, print them as JSON")
    up.add_argument("names", nargs="+", help="host names, e.g. proxy prefill decode")
    up.add_argument("--subnet", default=DEFAULT_SUBNET)
    sub.add_parser("down", help="kill what runs in the lab, delete its namespaces")
    sub.add_parser("list", help="print the lab as JSON")
    run = sub.add_parser("run", help="run a command on a host: hosts run decode -- CMD")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    for verb in ("cut", "restore"):
        sub.add_parser(verb, help=f"{verb} a host's link").add_argument("host")
    p.set_defaults(func=cmd_hosts)
    return p


def cmd_hosts(args: argparse.Namespace) -> int:
    try:
        if args.hosts_command == "up":
            print(json.dumps(Lab.up(args.names, args.lab, args.subnet).to_json(), indent=1))
        elif args.hosts_command == "down":
            try:
                lab = Lab.load(args.lab)
            except HostsError:
                lab = Lab(args.lab, {}, DEFAULT_SUBNET)  # a broken lab: remove what is left
            print("removed: " + (", ".join(lab.down()) or "nothing"))
        elif args.hosts_command == "list":
            print(json.dumps(Lab.load(args.lab).to_json(), indent=1))
        elif args.hosts_command == "run":
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv:
                raise HostsError("hosts run HOST -- CMD: no command given")
            return Lab.load(args.lab).run(args.host, argv).returncode
        else:
            lab = Lab.load(args.lab)
            getattr(lab, args.hosts_command)(args.host)
    except HostsError as exc:
        print(f"sfa-rd2h hosts: {exc}", file=sys.stderr)
        return 2
    return 0
