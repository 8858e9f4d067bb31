"""The one error family of the protocol: every rejection is a ``ProtocolError``.

Callers that only care whether input was acceptable catch ``ProtocolError``; the
subclasses say which layer of the spec refused it (wire, topology, layout, machine).
Messages name the rule ID so an operator can go from a log line to spec/PROTOCOL.md.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Input or an event that the RD2H protocol does not allow."""


class WireError(ProtocolError):
    """A frame that is not a well-formed RD2H message (W1-W5)."""


class TopologyError(ProtocolError):
    """A TP/port configuration the protocol cannot serve (T1, P1, P2)."""


class LayoutError(ProtocolError):
    """Source and destination cache layouts disagree (L1)."""


class VersionMismatch(ProtocolError):
    """Prefill and Decode speak different protocol or layout versions (F3)."""


class TransitionError(ProtocolError):
    """A trigger that the named machine does not accept in its current state."""

    def __init__(self, machine: str, state: str, event: str, detail: str = "") -> None:
        self.machine = machine
        self.state = state
        self.event = event
        msg = f"{machine}: event {event!r} is not allowed in state {state!r}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)
