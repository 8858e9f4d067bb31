"""The protocol's timing defaults and the order they must keep (C1, S5, S6).

Each side measures only its own durations, so no clock is shared: Prefill gives up on a
reader ``reply_timeout`` after publishing a layer (S5) and may then reuse the slot; Decode
counts a read as good only if it finished within ``read_budget`` of the READY's arrival
(S6), a budget that includes any wait for destinations (C1). A read Decode accepts therefore
finished before Prefill could have reused the slot, as long as a READY takes less than
``reply_timeout - read_budget`` to reach the Decode core (30 s with the defaults).
"""

from __future__ import annotations

from sfa_rd2h.spec.errors import ProtocolError

#: Prefill: a READY unanswered this long declares its reader lost (S5).
REPLY_TIMEOUT_S = 60.0
#: Prefill: an MF_META unacknowledged this long declares the reader lost (S5, W1); far
#: below ``reply_timeout``, so a hung Decode costs each new connection seconds, not minutes.
HANDSHAKE_TIMEOUT_S = 5.0
#: Decode: a read finishing later than this after its READY arrived fails (S6).
READ_BUDGET_S = 30.0
#: Decode: how long a READY waits for its request's destinations (C1).
DESTINATION_WAIT_S = 10.0
#: Decode: every contributor must be final by then, else the request fails (R1).
REQUEST_DEADLINE_S = 300.0


def check_timeouts(*, destination_wait: float | None = None, read_budget: float | None = None,
                   reply_timeout: float | None = None,
                   handshake_timeout: float | None = None) -> None:
    """Refuse timeouts that break S6: each given one positive (``destination_wait`` may be
    0), and ``destination_wait < read_budget < reply_timeout`` among those given
    (``handshake_timeout`` stands outside that order)."""
    given = [(n, v) for n, v in (("destination_wait", destination_wait),
                                 ("read_budget", read_budget),
                                 ("reply_timeout", reply_timeout)) if v is not None]
    for name, value in [*given, ("handshake_timeout", handshake_timeout)]:
        if value is None:
            continue
        zero_ok = name == "destination_wait"  # 0: a READY never waits for destinations
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                value >= 0 if zero_ok else value > 0):
            raise ProtocolError(f"S6: {name}={value!r} must be a "
                                f"{'non-negative' if zero_ok else 'positive'} number of seconds")
    for (lo_name, lo), (hi_name, hi) in zip(given, given[1:], strict=False):
        if not lo < hi:
            raise ProtocolError(
                f"S6: {lo_name}={lo:g} must be below {hi_name}={hi:g} (destination_wait < "
                "read_budget < reply_timeout: a READY's wait and read must end before "
                "Prefill may give up on the reader and reuse the slot)")
