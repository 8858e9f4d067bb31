"""Ports chosen by one process for another to bind a moment later (P1).

Asking the kernel for a free port (bind to port 0) hands out a port of its ephemeral range,
and the kernel also takes the source port of every outgoing connection from that range: on a
loaded machine another process's connection took such a port between the choice and the
bind (a Decode rank's P1 BindError in a demo loop). A port below the range is only ever taken
by an explicit bind, so every port this project picks for someone else comes from there,
probed by binding it once.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

FIRST_PORT = 10000  # below it lie the well-known and registered ports services listen on
LINUX_DEFAULT_LOW = 32768  # where Linux's ephemeral range starts by default
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class NoFreePort(OSError):
    """No free port (or span of ports) was found below the ephemeral range."""


def below_ephemeral() -> range:
    """The ports from FIRST_PORT up to the start of the kernel's ephemeral range."""
    try:
        low = int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = LINUX_DEFAULT_LOW
    return range(FIRST_PORT, max(low, FIRST_PORT + 1024))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_span(host: str, n: int = 1, *, attempts: int = 50,
              rng: random.Random | None = None) -> int:
    """A base port such that ``base .. base + n - 1`` are free on ``host`` (P1: one port per
    TP rank); the span is drawn at random so that concurrent callers rarely collide."""
    ports = below_ephemeral()
    draw = rng or random.SystemRandom()
    for _ in range(attempts):
        base = draw.randrange(ports.start, ports.stop - n + 1)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket(_family(host), socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise NoFreePort(f"no span of {n} free ports in {ports.start}-{ports.stop - 1} on {host} "
                     f"after {attempts} draws")


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host`` below the ephemeral range."""
    return free_span(host, 1)


def free_ports(n: int, host: str = "127.0.0.1", seed: int | None = None) -> list[int]:
    """``n`` distinct free ports on ``host`` below the ephemeral range, all held until every
    one is chosen (so none is handed out twice); ``seed`` makes the choice repeatable."""
    ports = below_ephemeral()
    candidates = list(ports)
    random.Random(seed).shuffle(candidates)
    held: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket(_family(host), socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
            if len(held) == n:
                return [int(x.getsockname()[1]) for x in held]
        raise NoFreePort(f"fewer than {n} free ports in {ports.start}-{ports.stop - 1} "
                         f"on {host}")
    finally:
        for s in held:
            s.close()
