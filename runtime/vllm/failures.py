"""Prefill tells the proxy at once when a request's KV will not reach its Decode (S5, S7).

Without this, the only process that knows (a Prefill rank that gave up on a reader, or
refused a request's ``kv_transfer_params``) answers its own 1-token call with 200, and
Decode waits for KV that never comes until ``request_deadline`` (R1, 300 s by default)
while the client waits with it. The proxy passes its metaserver URL in Prefill's
``kv_transfer_params`` (``metaserver``); a report posted there ends the completion with an
error naming the cause, and closing Decode's stream aborts the request there (vLLM frees its
blocks). A report is advice: one attempt, off the caller's thread, and the deadline still
covers a report that is lost.
"""

from __future__ import annotations

import logging
import queue
import threading

from sfa_rd2h.runtime.metaserver import ProxyRequestError, report_kv_failure

log = logging.getLogger(__name__)

#: Reports waiting for the thread; beyond this they are dropped with a warning (a Decode
#: that vanished can abandon thousands of requests at once, and each report is advice).
MAX_QUEUED = 4096


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
        self._queue: queue.Queue[tuple[str, str, str] | None] = queue.Queue(MAX_QUEUED)
        self._lock = threading.Lock()
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
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="rd2h-failure-report")
                self._thread.start()
        try:
            self._queue.put_nowait((metaserver_url, request_id, error))
        except queue.Full:
            self.dropped += 1
            log.warning("%s: failure report of %s dropped (%d queued)", self._who,
                        request_id, MAX_QUEUED)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            url, request_id, error = item
            try:
                report_kv_failure(url, request_id, error, reporter=self._who,
                                  timeout=self._timeout, token=self._token)
                self.sent += 1
            except (OSError, ProxyRequestError, ValueError) as exc:
                # 404: the proxy finished the completion already (Decode's answer won).
                self.undelivered += 1
                log.warning("%s: failure of %s not reported to %s: %s", self._who,
                            request_id, url, exc)

    def close(self, timeout: float) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return  # the thread is a daemon; it goes with the process
            thread.join(timeout)
