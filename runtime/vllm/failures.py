"""Prefill tells the proxy at once when a request's KV will not reach its Decode (S5, S7).

Without this, the only process that knows (a Prefill rank that gave up on a reader, or
refused a request's ``kv_transfer_params``) answers its own 1-token call with 200, and
Decode waits for KV that never comes until ``request_deadline`` (R1, 300 s by default)
while the client waits with it. The proxy passes its metaserver URL in Prefill's
``kv_transfer_params`` (``metaserver``); a report posted there ends the completion with an
error naming the cause, and closing Decode's stream aborts the request there (vLLM frees its
blocks). A report is advice, sent off the caller's thread: a transport error is retried
with backoff for about half a minute (the link that lost Decode may have taken the proxy
with it, and comes back), an HTTP answer is final, and the deadline still covers a report
that is never heard.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

from sfa_rd2h.runtime.metaserver import ProxyRequestError, report_kv_failure

log = logging.getLogger(__name__)

#: Reports waiting for the thread; beyond this they are dropped with a warning (a Decode
#: that vanished can abandon thousands of requests at once, and each report is advice).
MAX_QUEUED = 4096
#: Delays before each retry of a report that met a transport error (about 31 s in all).
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def handshake_hint(reason: str) -> str:
    """What to change, for the reasons a Prefill rank gives up on a reader."""
    if "MF_META not acknowledged" in reason:
        return ("Decode never answered the handshake at that address: it must be one "
                "Prefill reaches (the Decode connector's `host` in "
                "kv_connector_extra_config, and its kv_port)")
    if "no reply within" in reason:
        return "Decode stopped answering (Prefill's `reply_timeout`)"
    return "the connection to Decode was lost"


class FailureReporter:
    """One daemon thread that POSTs failure reports to the metaserver URLs given."""

    def __init__(self, who: str, *, timeout: float, token: str | None = None) -> None:
        self._who = who
        self._timeout = timeout
        self._token = token
        # (due, seq, attempt, url, request_id, error), earliest due first
        self._due: list[tuple[float, int, int, str, str, str]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed_at: float | None = None  # reports due by then still go out
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.undelivered = 0
        self.dropped = 0

    def report(self, metaserver_url: str | None, request_id: str, error: str) -> None:
        """Queue one report; never blocks. Without a URL (a peer that sent none) there is
        nobody to tell, and the request's deadline ends it as before."""
        log.error("%s: request %s: %s", self._who, request_id, error)
        if not metaserver_url:
            return
        with self._cond:
            if self._closed_at is not None:
                return
            if len(self._due) >= MAX_QUEUED:
                self.dropped += 1
                log.warning("%s: failure report of %s dropped (%d queued)", self._who,
                            request_id, MAX_QUEUED)
                return
            self._push(time.monotonic(), 0, metaserver_url, request_id, error)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="rd2h-failure-report")
                self._thread.start()

    def _push(self, due: float, attempt: int, url: str, request_id: str, error: str) -> None:
        heapq.heappush(self._due, (due, next(self._seq), attempt, url, request_id, error))
        self._cond.notify()

    def _next(self) -> tuple[int, str, str, str] | None:
        """The next report that is due, waiting for it; None once closed and nothing that
        was due at the close is left."""
        with self._cond:
            while True:
                due = self._due[0][0] if self._due else None
                if self._closed_at is not None and (due is None or due > self._closed_at):
                    return None
                if due is not None and due <= time.monotonic():
                    return heapq.heappop(self._due)[2:]
                self._cond.wait(None if due is None else due - time.monotonic())

    def _run(self) -> None:
        while (item := self._next()) is not None:
            attempt, url, request_id, error = item
            try:
                report_kv_failure(url, request_id, error, reporter=self._who,
                                  timeout=self._timeout, token=self._token)
                self.sent += 1
            except OSError as exc:
                if attempt < len(RETRY_DELAYS_S) and self._closed_at is None:
                    log.info("%s: failure report of %s to %s: %s (retrying)", self._who,
                             request_id, url, exc)
                    with self._cond:
                        self._push(time.monotonic() + RETRY_DELAYS_S[attempt], attempt + 1,
                                   url, request_id, error)
                    continue
                self._undelivered(request_id, url, exc)
            except (ProxyRequestError, ValueError) as exc:
                # 404: the proxy finished the completion already (Decode's answer won).
                self._undelivered(request_id, url, exc)

    def _undelivered(self, request_id: str, url: str, exc: Exception) -> None:
        self.undelivered += 1
        log.warning("%s: failure of %s not reported to %s: %s", self._who, request_id, url,
                    exc)

    def close(self, timeout: float) -> None:
        """Send what is due now, then stop; reports still waiting for a retry are dropped
        (the process is going away, and with it the requests they are about)."""
        with self._cond:
            thread = self._thread
            if self._closed_at is None:
                self._closed_at = time.monotonic()
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)
