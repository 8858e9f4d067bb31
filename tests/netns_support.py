"""Test hosts for the suite: ``hosts`` gives a test a lab of network namespaces and removes
it afterwards, whatever the test did; where namespaces cannot be made (no root, no
iproute2) the test fails under ``CI`` and skips elsewhere, saying why."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator, Sequence

import pytest

from sfa_rd2h.runtime.tools import hosts as hosts_mod

MADE: set[str] = set()  # every lab a test made in this process, for the final check


def require_namespaces() -> None:
    reason = hosts_mod.unavailable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"network namespaces are needed here (CI): {reason}", pytrace=False)
    pytest.skip(f"network namespaces unavailable: {reason}")


def lab_name() -> str:
    """A lab name no other run on this machine uses at the same time."""
    return "t" + secrets.token_hex(3)


@pytest.fixture
def hosts() -> Iterator[Callable[..., hosts_mod.Lab]]:
    """``hosts("prefill", "decode")`` makes a lab; every lab made is removed at the end."""
    require_namespaces()
    labs: list[hosts_mod.Lab] = []

    def make(*names: str, **kw: object) -> hosts_mod.Lab:
        lab = hosts_mod.Lab.up(names, lab_name(), **kw)  # type: ignore[arg-type]
        MADE.add(lab.name)
        labs.append(lab)
        return lab

    try:
        yield make
    finally:
        for lab in labs:
            lab.down()


def left_behind(names: Sequence[str]) -> list[str]:
    """Namespaces of the labs ``names`` that still exist."""
    return [ns for ns in hosts_mod.list_namespaces()
            if any(ns.startswith(f"{n}-") for n in names)]
