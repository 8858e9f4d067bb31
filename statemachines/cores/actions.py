"""What the sans-IO cores ask the world to do.

Cores return lists of these; the threaded runtime executes them on sockets and transfer
engines, the model checker executes them on a simulated network and memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from sfa_rd2h.spec.layout import ReadPlan


@dataclass(frozen=True, slots=True)
class Send:
    """Send one payload frame to a peer (Prefill: a Decode endpoint; Decode: a ZMQ identity)."""

    peer: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class IssueRead:
    """Run one synchronous batched read from ``session`` and report it via ``read_result``."""

    read_id: int
    session: str
    plan: ReadPlan


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close the connection to a Decode endpoint; the next frame for it opens a new one
    (W1), so a late reply to an abandoned publication can never count for a new one (S5)."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class RequestReady:
    """A Decode rank reached a local terminal state for a request: gather it over TP (R1)."""

    ext_req_id: str
    ok: bool


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """A request reached its terminal state on this Decode rank (R1, R2)."""

    ext_req_id: str
    ok: bool
    error: str | None


Action = Send | IssueRead | Disconnect | RequestReady | RequestFinished
