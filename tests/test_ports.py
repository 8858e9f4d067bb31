"""runtime/ports.py: every port the project chooses for another process to bind lies below
the kernel's ephemeral range, is free when chosen, and is never handed out twice at once."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from sfa_rd2h.runtime import ports


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_the_range_ends_where_the_kernels_ephemeral_range_starts() -> None:
    r = ports.below_ephemeral()
    assert r.start == ports.FIRST_PORT and r.stop == max(_ephemeral_low(), r.start + 1024)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_span_is_free_and_below_the_ephemeral_range(n: int) -> None:
    base = ports.free_span("127.0.0.1", n)
    assert ports.FIRST_PORT <= base and base + n - 1 < _ephemeral_low(), (base, n)
    for port in range(base, base + n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it after the probe


def test_a_port_in_use_is_never_chosen() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        held = taken.getsockname()[1]
        # A seeded draw that starts on the held port must skip it.
        rng = random.Random(0)
        first = random.Random(0).randrange(ports.below_ephemeral().start,
                                           ports.below_ephemeral().stop)
        with socket.socket() as at_first:
            at_first.bind(("127.0.0.1", first))
            assert ports.free_span("127.0.0.1", 1, rng=rng) != first
        assert all(ports.free_port() != held for _ in range(200))


def test_distinct_ports_are_held_until_all_are_chosen() -> None:
    chosen = ports.free_ports(8, seed=1)
    assert len(set(chosen)) == 8 and chosen == ports.free_ports(8, seed=1)
    assert all(ports.FIRST_PORT <= p < _ephemeral_low() for p in chosen)
    for p in chosen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_running_out_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        only = taken.getsockname()[1]
        monkeypatch.setattr(ports, "below_ephemeral", lambda: range(only, only + 1))
        with pytest.raises(ports.NoFreePort, match=f"no span of 1 free ports in {only}-"):
            ports.free_span("127.0.0.1", 1, attempts=3)
        with pytest.raises(ports.NoFreePort, match=f"fewer than 1 free ports in {only}-"):
            ports.free_ports(1)
