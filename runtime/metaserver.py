"""The proxy's metaserver: the D-first ("Mooncake layerwise") rendezvous of C1/C3 and F1.

Flow (seed 001, "Mooncake layerwise"): the proxy hands a request to a Decode instance with
``do_remote_prefill=true`` and the metaserver URL; Decode allocates its destinations and
POSTs a :class:`Rendezvous` to ``/v1/metaserver``; once every sub-request of the original
job has done so (C3), the proxy dispatches the job once to a Prefill instance with
``do_remote_decode=true``. Prefill pushes KV layer by layer; both sides report completion.

:class:`ProxyServer` is a small, real HTTP server for this flow (in-memory queues that the
Prefill and Decode processes long-poll). :func:`post_rendezvous` is Decode's side of the
rendezvous, retrying transport errors and a busy server's 503 only (F1).

HTTP endpoints (all JSON; errors are ``{"error": "..."}`` with a 4xx/5xx status):

- ``GET  /v1/decode_work?instance=NAME&timeout=S`` - long poll; list of
  ``{request_id, job, index, prompt, num_tokens, metaserver, kv_transfer_params}``.
- ``POST /v1/metaserver`` - a rendezvous (or a vLLM-style ``kv_transfer_params`` body with
  the same keys); 200 ``{"status": "ok"}``, 400 on a bad body, 404 for an unknown id.
- ``GET  /v1/prefill_work?instance=NAME&timeout=S`` - long poll; list of
  ``{job, prompts, max_completion_tokens, min_tokens, requests: [{request_id, prompt,
  num_tokens, kv_transfer_params}]}`` where ``kv_transfer_params`` is a rendezvous.
- ``POST /v1/finished`` - ``{request_id, ok, role, error?}`` with role prefill or decode.
- ``GET  /v1/status?job=ID`` and ``GET /v1/health``.

Work is handed out at most once: a long poll takes everything queued for its instance.
"""

from __future__ import annotations

import hmac
import http.client
import ipaddress
import itertools
import json
import logging
import math
import os
import select
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.wire import MAX_ID_LEN

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
MAX_POLL_S = 30.0  # a long poll never holds a handler thread longer than this
MAX_HANDLERS = 64  # concurrent client connections; more are answered 503 at once
IO_TIMEOUT_S = 5.0  # one socket read or write of a client
REQUEST_DEADLINE_S = 10.0  # a whole request beyond its long poll, however slowly it dribbles
RENDEZVOUS_TIMEOUT_S = 2.0  # client: the first rendezvous POST attempt (F1 retries on top)
# client: every attempt of one rendezvous POST together. Each retry waits twice as long as
# the one before, within this: a proxy that is only slow (a loaded host) is heard by a
# later attempt instead of being declared unreachable after six short ones.
RENDEZVOUS_BUDGET_S = 30.0
WORK_POLL_S = 10.0  # client: how long one long poll of a work queue may wait
RESPONSE_SLACK_S = 5.0  # client: beyond a long poll's wait, for the answer to arrive
FINISHED_TIMEOUT_S = 5.0  # client: one /v1/finished report
CLOSE_TIMEOUT_S = 10.0  # ProxyServer.close(): clients cut and the serving thread joined
TOKEN_ENV = "SFA_RD2H_METASERVER_TOKEN"  # a shared bearer token, off unless set


def _auth_headers(token: str | None) -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV) if token is None else token
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers
MAX_HOST_LEN = 255
ROLES = ("prefill", "decode")


class RendezvousError(ProtocolError):
    """A rendezvous body that the protocol does not allow; ``field`` names the culprit."""

    def __init__(self, field_name: str, detail: str) -> None:
        self.field = field_name
        super().__init__(f"rendezvous field {field_name!r}: {detail}")


class MetaserverUnreachable(ConnectionError):
    """Every attempt to reach the metaserver failed at the transport level (F1)."""

    def __init__(self, url: str, attempts: int, last: BaseException) -> None:
        self.url = url
        self.attempts = attempts
        self.last_error = last
        super().__init__(
            f"metaserver {url} unreachable after {attempts} attempt(s) (F1): "
            f"{type(last).__name__}: {last}"
        )


class ProxyRequestError(RuntimeError):
    """The proxy answered a work/finished call with an error status."""

    def __init__(self, url: str, status: int, message: str) -> None:
        self.url = url
        self.status = status
        super().__init__(f"{url}: HTTP {status}: {message}")


# --------------------------------------------------------------------------- rendezvous


def _int_field(obj: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int) -> int:
    value = obj.get(name)
    if value is None:
        if default is None:
            raise RendezvousError(name, "is required")
        return default
    # bool is an int subclass; a JSON true must not pass as a port or a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise RendezvousError(name, f"expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise RendezvousError(name, f"{value} is outside {lo}..{hi}")
    return value


def _str_field(obj: Mapping[str, Any], name: str, max_len: int) -> str:
    value = obj.get(name)
    if value is None:
        raise RendezvousError(name, "is required")
    if not isinstance(value, str):
        raise RendezvousError(name, f"expected a string, got {type(value).__name__}")
    if not value or len(value) > max_len:
        raise RendezvousError(name, f"length {len(value)} is outside 1..{max_len}")
    return value


def _bool_field(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise RendezvousError(name, f"expected a boolean, got {type(value).__name__}")
    return value


def _fraction_field(obj: Mapping[str, Any], name: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RendezvousError(name, f"expected a number, got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise RendezvousError(name, f"{value} is outside 0..1")
    return float(value)


def _flag(obj: Mapping[str, Any], name: str, expected: bool, rule: str) -> bool:
    # Missing means the expected value: some callers only send the keys that carry data.
    value = _bool_field(obj, name, expected)
    if value is not expected:
        raise RendezvousError(name, f"must be {str(expected).lower()} in a rendezvous ({rule})")
    return value


@dataclass(frozen=True)
class Rendezvous:
    """What Decode advertises for one external request (C1, P2). No D block ids (C1)."""

    request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int  # D base port; P adds the mapped D TP rank (P1, P2)
    remote_tp_size: int
    remote_pcp_size: int = 1
    remote_dcp_size: int = 1
    remote_cached_tokens: int = 0
    do_remote_prefill: bool = False
    do_remote_decode: bool = True
    # C5: this Decode never writes its own local prefix hit, whatever blocks Prefill names,
    # so a proxy may dispatch to Prefill before this rendezvous arrives (C3). A rendezvous
    # carries it only when true, so one without it reads as before.
    keeps_local_prefix: bool = False
    # C3: this Decode's room once this request was admitted - the share of its KV blocks
    # still free, its free sequence slots and how many it has in all - so a proxy
    # dispatches early only to a Decode that can admit the next request at once. None: not
    # said (sent only when known).
    free_kv_share: float | None = None
    free_seq_slots: int | None = None
    seq_slots: int | None = None

    def __post_init__(self) -> None:
        # Constructing one in code goes through the same checks as one read off the wire,
        # so a Decode can never post what a Prefill would refuse.
        Rendezvous.from_json(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "do_remote_prefill": self.do_remote_prefill,
            "do_remote_decode": self.do_remote_decode,
            "remote_engine_id": self.remote_engine_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_tp_size": self.remote_tp_size,
            "remote_pcp_size": self.remote_pcp_size,
            "remote_dcp_size": self.remote_dcp_size,
            "remote_cached_tokens": self.remote_cached_tokens,
        } | ({"keeps_local_prefix": True} if self.keeps_local_prefix else {}) | {
            name: value for name, value in (("free_kv_share", self.free_kv_share),
                                            ("free_seq_slots", self.free_seq_slots),
                                            ("seq_slots", self.seq_slots))
            if value is not None}

    @classmethod
    def from_json(cls, obj: object) -> Rendezvous:
        """Validate a decoded JSON object. Unknown keys are ignored (W4-style extension);
        a missing or null ``remote_cached_tokens`` is 0 (known failure 7)."""
        if not isinstance(obj, Mapping):
            raise RendezvousError("<body>", f"expected a JSON object, got {type(obj).__name__}")
        request_id = _str_field(obj, "request_id", MAX_ID_LEN)
        engine_id = _str_field(obj, "remote_engine_id", MAX_ID_LEN)
        host = _str_field(obj, "remote_host", MAX_HOST_LEN)
        if any(c.isspace() for c in host):
            raise RendezvousError("remote_host", f"{host!r} contains whitespace")
        try:
            unspecified = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            unspecified = False  # a host name, resolved by Prefill
        if unspecified:
            # Prefill cannot connect to a wildcard address; D must advertise a reachable one.
            raise RendezvousError("remote_host", f"{host!r} is a wildcard, not a reachable host")
        port = _int_field(obj, "remote_port", None, 1, 65535)
        tp = _int_field(obj, "remote_tp_size", None, 1, 65535)
        if port + tp - 1 > 65535:
            raise RendezvousError(
                "remote_port",
                f"base port {port} + tp {tp} - 1 = {port + tp - 1} exceeds 65535 (P2)",
            )
        # X3: Decode supports TP only; CP sizes other than 1 are a validated limit.
        pcp = _int_field(obj, "remote_pcp_size", 1, 1, 1)
        dcp = _int_field(obj, "remote_dcp_size", 1, 1, 1)
        cached = _int_field(obj, "remote_cached_tokens", 0, 0, 2**63 - 1)
        prefill = _flag(obj, "do_remote_prefill", False, "C1: Decode clears it")
        decode = _flag(obj, "do_remote_decode", True, "Prefill must push to Decode")
        keeps = _bool_field(obj, "keeps_local_prefix", False)
        free_kv = _fraction_field(obj, "free_kv_share")
        free_seqs, all_seqs = (None if obj.get(name) is None
                               else _int_field(obj, name, None, least, 2**31 - 1)
                               for name, least in (("free_seq_slots", 0), ("seq_slots", 1)))
        if free_seqs is not None and all_seqs is not None and free_seqs > all_seqs:
            raise RendezvousError("free_seq_slots", f"{free_seqs} free of {all_seqs} "
                                  "sequence slots in all (seq_slots)")
        inst = object.__new__(cls)
        for name, value in (
            ("request_id", request_id),
            ("remote_engine_id", engine_id),
            ("remote_host", host),
            ("remote_port", port),
            ("remote_tp_size", tp),
            ("remote_pcp_size", pcp),
            ("remote_dcp_size", dcp),
            ("remote_cached_tokens", cached),
            ("do_remote_prefill", prefill),
            ("do_remote_decode", decode),
            ("keeps_local_prefix", keeps),
            ("free_kv_share", free_kv),
            ("free_seq_slots", free_seqs),
            ("seq_slots", all_seqs),
        ):
            object.__setattr__(inst, name, value)
        return inst


# --------------------------------------------------------------------------- clients

# The metaserver is an intra-cluster endpoint: an HTTP proxy from the environment
# (http_proxy) would silently divert the rendezvous, so clients here never use one.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _check_url(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s) URL, got {url!r}")


def post_rendezvous(
    url: str,
    rendezvous: Rendezvous,
    *,
    retries: int = 5,
    backoff: float = 0.05,
    timeout: float = RENDEZVOUS_TIMEOUT_S,
    sleep: Callable[[float], None] = time.sleep,
    token: str | None = None,
    budget: float = RENDEZVOUS_BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """POST a rendezvous to the metaserver URL and return the HTTP status (F1).

    Transport errors (refused, reset, timeout, malformed response) are retried up to
    ``retries`` times, sleeping ``backoff * 2**k`` before retry ``k``; then
    :class:`MetaserverUnreachable` is raised. Attempt ``k`` waits up to ``timeout * 2**k``
    for its answer, cut to what is left of ``budget``: the time the attempts took together
    (a refused connect takes none; the backoff sleeps are not counted). A 503 Service
    Unavailable is retried the same way: the server says it took nothing (too busy,
    shutting down), and a repeated rendezvous is harmless (a duplicate is absorbed). Any
    other HTTP response, 4xx/5xx included, counts as delivered (old proxies answer errors
    for requests they did accept) and is returned.
    """
    _check_url(url)
    if retries < 0 or backoff < 0 or timeout <= 0:
        raise ValueError("retries and backoff must be >= 0 and timeout > 0")
    if budget < timeout:
        raise ValueError(f"budget={budget} is below the first attempt's timeout={timeout}")
    if not isinstance(rendezvous, Rendezvous):
        raise TypeError(f"expected a Rendezvous, got {type(rendezvous).__name__}")
    body = json.dumps(rendezvous.to_json()).encode()
    last: BaseException | None = None
    left, attempts = budget, 0
    for attempt in range(retries + 1):
        if left <= 0:
            break
        if attempt:
            sleep(backoff * 2 ** (attempt - 1))
        wait = min(timeout * 2 ** attempt, left)
        attempts += 1
        started = clock()
        req = urllib.request.Request(url, data=body, method="POST", headers=_auth_headers(token))
        try:
            with _OPENER.open(req, timeout=wait) as resp:
                resp.read()
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            with exc:
                log.warning(
                    "metaserver %s answered %s for %s", url, exc.code, rendezvous.request_id
                )
                if exc.code != HTTPStatus.SERVICE_UNAVAILABLE:
                    return int(exc.code)
                last = exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            # URLError wraps connect-time failures; a timeout or reset while reading the
            # response surfaces as a bare OSError / HTTPException.
            last = exc
        left -= clock() - started
        log.info("metaserver %s attempt %d failed: %s", url, attempt + 1, last)
    assert last is not None
    raise MetaserverUnreachable(url, attempts, last) from last


def _call(url: str, body: Mapping[str, Any] | None, timeout: float,
          token: str | None = None) -> Any:
    _check_url(url)
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers=_auth_headers(token),
    )
    try:
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            with exc:
                raw = exc.read()
            try:
                message = str(json.loads(raw)["error"])
            except (ValueError, KeyError, TypeError):
                message = raw[:200].decode("utf-8", "replace")
            raise ProxyRequestError(url, exc.code, message) from None
    except http.client.HTTPException as exc:
        if isinstance(exc, OSError):
            raise  # RemoteDisconnected is already a ConnectionResetError
        # An answer cut off mid-body (IncompleteRead: a proxy closing, a dying peer) is a
        # transport failure like a refused connection; callers handle OSError, not this.
        raise ConnectionError(f"{url}: answer cut off: {exc!r}") from exc


def fetch_work(
    base_url: str, role: str, instance: str, *, timeout: float = WORK_POLL_S
) -> list[dict[str, Any]]:
    """Long-poll the proxy for work queued for ``instance`` (role ``decode``/``prefill``).

    Returns ``[]`` when nothing arrived within ``timeout`` seconds."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    query = urllib.parse.urlencode({"instance": instance, "timeout": timeout})
    url = f"{base_url.rstrip('/')}/v1/{role}_work?{query}"
    items = _call(url, None, timeout + RESPONSE_SLACK_S)
    if not isinstance(items, list):
        raise ProxyRequestError(url, 200, f"expected a JSON list, got {type(items).__name__}")
    return items


def report_finished(
    base_url: str,
    request_id: str,
    *,
    ok: bool,
    role: str,
    error: str | None = None,
    timeout: float = FINISHED_TIMEOUT_S,
) -> None:
    """Tell the proxy that ``role`` finished sub-request ``request_id``."""
    body: dict[str, Any] = {"request_id": request_id, "ok": ok, "role": role}
    if error is not None:
        body["error"] = error
    _call(f"{base_url.rstrip('/')}/v1/finished", body, timeout)


MAX_FAILURE_LEN = 2000  # a failure report's text; longer is cut, never refused


def failure_url(metaserver_url: str) -> str:
    """Where a request's KV failure is reported, beside the rendezvous URL it came with."""
    return f"{metaserver_url.rstrip('/')}/failed"


def report_kv_failure(
    metaserver_url: str,
    request_id: str,
    error: str,
    *,
    reporter: str,
    timeout: float = FINISHED_TIMEOUT_S,
    token: str | None = None,
) -> None:
    """Tell the metaserver that the KV of ``request_id`` will not reach its Decode (S5,
    S7), so the proxy can end the request at once instead of at Decode's deadline (R1).

    One attempt: the report is advice, the deadline still covers a report that is lost.
    Raises ``OSError`` (transport) or :class:`ProxyRequestError` (an HTTP error answer)."""
    body = {"request_id": request_id, "error": error[:MAX_FAILURE_LEN], "reporter": reporter}
    _call(failure_url(metaserver_url), body, timeout, token)


# --------------------------------------------------------------------------- proxy state


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


@dataclass
class _Sub:
    request_id: str
    index: int
    prompt: str
    num_tokens: int
    decode_fetched: bool = False
    rendezvous: Rendezvous | None = None
    ok: dict[str, bool] = field(default_factory=dict)  # role -> ok
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return False in self.ok.values() or len(self.ok) == len(ROLES)

    @property
    def state(self) -> str:
        if False in self.ok.values():
            return "failed"
        if len(self.ok) == len(ROLES):
            return "done"
        if self.rendezvous is not None:
            return "rendezvous"
        return "at_decode" if self.decode_fetched else "queued"


@dataclass
class _Job:
    job_id: str
    prompts: list[str]
    decode_instance: str
    prefill_instance: str
    subs: list[_Sub]
    dispatched: bool = False
    prefill_fetched: bool = False

    @property
    def done(self) -> bool:
        return all(s.terminal for s in self.subs)


def _num_tokens(prompt: str) -> int:
    # Stand-in tokenizer for the demo: one token per UTF-8 byte. Proxy, Prefill and Decode
    # read the count from the work items, so they always agree on it.
    return len(prompt.encode("utf-8"))


class _Server(ThreadingHTTPServer):
    """The HTTP server with every client bounded: at most ``MAX_HANDLERS`` at once, each
    connection cut once its deadline passes (a client dribbling a byte per socket timeout
    cannot hold a thread), and ``abort_clients`` cuts them all so close() is bounded."""

    daemon_threads = True  # close() cuts every client first; nothing keeps the process alive
    block_on_close = False
    request_queue_size = 128  # listen backlog

    def __init__(self, addr: tuple[str, int], proxy: ProxyServer) -> None:
        self.proxy = proxy
        self._clients: dict[socket.socket, float] = {}
        self._clients_lock = threading.Lock()
        self._aborted = False
        super().__init__(addr, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client cut by its deadline or by close() makes the handler's last write fail;
        # that is the cut working, not an error worth a traceback on stderr.
        if isinstance(sys.exc_info()[1], OSError):
            log.debug("metaserver: client %s cut", client_address, exc_info=True)
        else:
            log.exception("metaserver: handler for %s failed", client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        deadline = time.monotonic() + self.proxy.max_poll_s + self.proxy.request_deadline
        with self._clients_lock:
            aborted = self._aborted
            busy = len(self._clients) >= self.proxy.max_handlers
            if not (busy or aborted):
                self._clients[request] = deadline
        if aborted:  # accepted while close() runs: no later sweep would cut it
            self.shutdown_request(request)
            return
        if busy:
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._clients_lock:
            self._clients.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Runs between polls of serve_forever: cut clients past their deadline."""
        now = time.monotonic()
        with self._clients_lock:
            late = [s for s, t in self._clients.items() if t <= now]
        for sock in late:
            _cut(sock)

    def abort_clients(self) -> None:
        with self._clients_lock:
            self._aborted = True
            clients = list(self._clients)
        for sock in clients:
            _cut(sock)


def _cut(sock: socket.socket) -> None:
    """Make a handler's blocked read or write return at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    # A socket timeout bounds each read or write of a slow or silent client; the server's
    # per-request deadline bounds the whole request.
    timeout = IO_TIMEOUT_S
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def send_response_only(self, code: int, message: str | None = None) -> None:
        # http.server answers a request line it cannot parse, or one claiming HTTP/0.9, in
        # HTTP/0.9 form: a bare body with no status line (and nothing at all for HEAD). A
        # client then cannot tell an error from a hang-up, so every answer here is HTTP/1.0.
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        super().send_response_only(code, message)

    def _reply(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        proxy = self.server.proxy
        try:
            if proxy.auth_token and not hmac.compare_digest(
                    self.headers.get("Authorization", "").encode(),
                    f"Bearer {proxy.auth_token}".encode()):
                self.close_connection = True
                raise _HttpError(401, "a valid 'Authorization: Bearer <token>' is required")
            parts = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
            if method == "POST":
                body = self._read_json(proxy.max_body)
                status, payload = proxy._post(parts.path, body)
            else:
                status, payload = proxy._get(parts.path, query)
                if parts.path in _WORK_PATHS and payload and not self._client_alive():
                    # The long poll's client died while it waited (a crashed rank): the
                    # work goes back to its queue instead of into a dead socket.
                    proxy._requeue(parts.path, query, payload)
                    self.close_connection = True
                    return
        except _HttpError as exc:
            status, payload = exc.status, {"error": str(exc)}
        except OSError as exc:  # the client went away or stalled past the socket timeout
            log.info("metaserver: client %s dropped: %s", self.address_string(), exc)
            self.close_connection = True
            return
        except Exception as exc:  # a bug must cost one request, never the server
            log.exception("metaserver: internal error on %s %s", method, self.path)
            status, payload = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        try:
            self._reply(status, payload)
        except OSError as exc:
            log.info("metaserver: reply to %s lost: %s", self.address_string(), exc)

    def _client_alive(self) -> bool:
        """Whether the client still holds its end of the connection (a peek, never a read):
        EOF or a reset means it is gone. A write to a dead peer can still succeed into the
        kernel's buffer, so this is asked before the work is written, not after."""
        try:
            # poll first: with a socket timeout set, recv would wait for data up to it
            # (poll, not select: a socket numbered past 1024 is past what select takes)
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            if not poller.poll(0):
                return True  # nothing to read: a live client waiting for its answer
            return self.connection.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    def _read_json(self, limit: int) -> Any:
        raw_len = self.headers.get("Content-Length")
        if raw_len is None:
            raise _HttpError(411, "Content-Length is required")
        try:
            length = int(raw_len)
        except ValueError:
            raise _HttpError(400, f"bad Content-Length {raw_len!r}") from None
        if length < 0:
            raise _HttpError(400, f"bad Content-Length {raw_len!r}")
        if length > limit:
            # The body is left unread; the connection is closed after the reply.
            self.close_connection = True
            raise _HttpError(413, f"body of {length} bytes exceeds the limit of {limit}")
        data = self.rfile.read(length)
        if len(data) != length:
            raise _HttpError(400, f"body truncated: {len(data)} of {length} bytes")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            # ValueError: bad UTF-8, bad JSON, or an integer over Python's digit limit;
            # RecursionError: nesting deeper than the decoder's stack. All are bad bodies.
            raise _HttpError(400, f"body is not valid JSON: {exc}") from None

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        self._serve("POST")


def _query_str(query: Mapping[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values or not values[0]:
        raise _HttpError(400, f"query parameter {name!r} is required")
    return values[0]


def _query_timeout(query: Mapping[str, list[str]], cap: float) -> float:
    values = query.get("timeout")
    if not values:
        return 0.0
    try:
        value = float(values[0])
    except ValueError:
        raise _HttpError(400, f"query parameter 'timeout': not a number: {values[0]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise _HttpError(400, f"query parameter 'timeout': {value} is not a finite number >= 0")
    return min(value, cap)


class _Closing(Exception):
    pass


_WORK_PATHS = ("/v1/decode_work", "/v1/prefill_work")


class ProxyServer:
    """A real HTTP proxy/metaserver for the D-first flow, serving on a background thread.

    ``start()`` binds and returns the base URL; ``close()`` wakes long polls, stops the
    server and joins its threads (bounded by the long-poll cap and the handler socket
    timeout). Use as a context manager.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        max_body: int = MAX_BODY_BYTES,
        max_poll_s: float = MAX_POLL_S,
        max_handlers: int = MAX_HANDLERS,
        request_deadline: float = REQUEST_DEADLINE_S,
        auth_token: str | None = None,
    ) -> None:
        if max_body <= 0 or max_poll_s < 0 or max_handlers < 1 or request_deadline <= 0:
            raise ValueError("max_body, max_handlers and request_deadline must be > 0 and "
                             "max_poll_s >= 0")
        if advertise_host is not None and not isinstance(advertise_host, str):
            raise ValueError(f"advertise_host must be a host name (str), got "
                             f"{type(advertise_host).__name__}")
        self.max_handlers = max_handlers
        self.request_deadline = request_deadline
        # Off unless given (or set in SFA_RD2H_METASERVER_TOKEN): every request must then
        # carry the token, so no one else can post rendezvous or take work.
        self.auth_token = os.environ.get(TOKEN_ENV) if auth_token is None else auth_token
        self._bind = (host, port)
        self._advertise_host = advertise_host
        self.max_body = max_body
        self.max_poll_s = max_poll_s
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._subs: dict[str, tuple[_Job, _Sub]] = {}
        self._decode_q: dict[str, deque[dict[str, Any]]] = {}
        self._prefill_q: dict[str, deque[dict[str, Any]]] = {}
        self._closing = False
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self._seq = itertools.count()

    # -- lifecycle

    def start(self) -> str:
        """Bind, start serving, and return the base URL (``http://host:port``)."""
        if self._server is not None or self._closing:
            raise RuntimeError("ProxyServer can be started once")
        server = _Server(self._bind, self)
        try:
            host, port = server.server_address[:2]
            shown = self._advertise_host or str(host)
            if ":" in shown:
                shown = f"[{shown}]"
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name="metaserver-http",
                daemon=True,
            )
            thread.start()
        except BaseException:
            # Nothing serves yet: release the port here, since close() would otherwise
            # wait in shutdown() for a serve_forever that never ran.
            server.server_close()
            raise
        self._server, self._thread = server, thread
        self._url = f"http://{shown}:{port}"
        return self._url

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("ProxyServer is not started")
        return self._url

    @property
    def metaserver_url(self) -> str:
        """Where Decode posts its rendezvous."""
        return f"{self.url}/v1/metaserver"

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            # long polls answer 503 now, unless abort_clients below cuts them first: a
            # client sees a 503 or a closed connection, never a hang
            self._cond.notify_all()
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        deadline = time.monotonic() + timeout
        server.abort_clients()  # long polls are woken; slow clients are cut, not waited for
        server.shutdown()
        thread.join(max(0.0, deadline - time.monotonic()))
        server.server_close()
        if thread.is_alive():
            log.error("metaserver: serving thread still alive %.1fs after close", timeout)

    def __enter__(self) -> ProxyServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- driver API

    def submit(
        self,
        prompts: Sequence[str] | str,
        decode_instance: str,
        prefill_instance: str,
        *,
        job_id: str | None = None,
    ) -> str:
        """Register a completion request and queue one sub-request per prompt for Decode
        (C3). Returns the job id; sub-request ids are ``f"{job_id}-{i}"``, as vLLM names the
        requests of a prompt list."""
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        if not items:
            raise ValueError("prompts must not be empty")
        for i, p in enumerate(items):
            if not isinstance(p, str) or not p:
                raise ValueError(f"prompt {i} must be a non-empty string")
        for name, value in (
            ("decode_instance", decode_instance),
            ("prefill_instance", prefill_instance),
        ):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string")
        if job_id is None:
            job_id = f"cmpl-{uuid.uuid4().hex}-{next(self._seq)}"
        elif not isinstance(job_id, str) or not job_id or len(job_id) > MAX_ID_LEN - 12:
            raise ValueError(
                f"job_id must be a non-empty string of at most {MAX_ID_LEN - 12} characters"
            )
        meta = self.metaserver_url
        subs = [_Sub(f"{job_id}-{i}", i, p, _num_tokens(p)) for i, p in enumerate(items)]
        job = _Job(job_id, items, decode_instance, prefill_instance, subs)
        with self._cond:
            if self._closing:
                raise RuntimeError("ProxyServer is closed")
            if job_id in self._jobs or any(s.request_id in self._subs for s in subs):
                raise ValueError(f"job id {job_id!r} is already in use")
            self._jobs[job_id] = job
            queue = self._decode_q.setdefault(decode_instance, deque())
            for s in subs:
                self._subs[s.request_id] = (job, s)
                queue.append(
                    {
                        "request_id": s.request_id,
                        "job": job_id,
                        "index": s.index,
                        "prompt": s.prompt,
                        "num_tokens": s.num_tokens,
                        "metaserver": meta,
                        "kv_transfer_params": {
                            "do_remote_prefill": True,
                            "do_remote_decode": False,
                            "metaserver": meta,
                        },
                    }
                )
            self._cond.notify_all()
        return job_id

    def status(self, job_id: str) -> dict[str, Any]:
        """Per-sub-request state of a job; ``KeyError`` for an unknown id."""
        with self._cond:
            return self._status(self._job(job_id))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, Any]:
        """Block until every sub-request of the job is terminal (both roles reported, or
        one reported failure); return its status. ``TimeoutError`` otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            job = self._job(job_id)
            while not job.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"job {job_id} not finished after {timeout}s: {self._status(job)}"
                    )
                self._cond.wait(remaining)
            return self._status(job)

    # -- internals (called with or taking self._cond)

    def _job(self, job_id: str) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise KeyError(f"unknown job {job_id!r}") from None

    @staticmethod
    def _status(job: _Job) -> dict[str, Any]:
        done = job.done
        return {
            "job": job.job_id,
            "done": done,
            "ok": done and all(all(s.ok.values()) for s in job.subs),
            "dispatched": job.dispatched,
            "prefill_fetched": job.prefill_fetched,
            "decode_instance": job.decode_instance,
            "prefill_instance": job.prefill_instance,
            "requests": [
                {
                    "request_id": s.request_id,
                    "state": s.state,
                    "rendezvous": s.rendezvous is not None,
                    "prefill_ok": s.ok.get("prefill"),
                    "decode_ok": s.ok.get("decode"),
                    "errors": dict(s.errors),
                }
                for s in job.subs
            ],
        }

    def _get(self, path: str, query: Mapping[str, list[str]]) -> tuple[int, Any]:
        if path == "/v1/health":
            return 200, {"status": "ok"}
        if path == "/v1/status":
            job_id = _query_str(query, "job")
            with self._cond:
                job = self._jobs.get(job_id)
                if job is None:
                    raise _HttpError(404, f"unknown job {job_id!r}")
                return 200, self._status(job)
        if path in ("/v1/decode_work", "/v1/prefill_work"):
            instance = _query_str(query, "instance")
            timeout = _query_timeout(query, self.max_poll_s)
            queues = self._decode_q if path == "/v1/decode_work" else self._prefill_q
            try:
                return 200, self._take(queues, instance, timeout, path == "/v1/decode_work")
            except _Closing:
                raise _HttpError(503, "metaserver is shutting down") from None
        raise _HttpError(404, f"no such endpoint: GET {path}")

    def _requeue(self, path: str, query: Mapping[str, list[str]],
                 items: list[dict[str, Any]]) -> None:
        """Work a long poll took for a client that is gone goes back to the front of its
        queue, in order, for the instance's next poll."""
        decode = path == "/v1/decode_work"
        queues = self._decode_q if decode else self._prefill_q
        with self._cond:
            queues.setdefault(_query_str(query, "instance"), deque()).extendleft(
                reversed(items))
            self._mark_fetched(items, decode, False)
            self._cond.notify_all()

    def _mark_fetched(self, items: list[dict[str, Any]], decode: bool, fetched: bool) -> None:
        """Whether the work items are out with a poller (lock held)."""
        for item in items:
            if decode:
                self._subs[item["request_id"]][1].decode_fetched = fetched
            else:
                self._jobs[item["job"]].prefill_fetched = fetched

    def _take(
        self,
        queues: dict[str, deque[dict[str, Any]]],
        instance: str,
        timeout: float,
        decode: bool,
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closing:
                    raise _Closing
                queue = queues.get(instance)
                if queue:
                    items = list(queue)
                    queue.clear()
                    self._mark_fetched(items, decode, True)
                    self._cond.notify_all()
                    return items
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)

    def _post(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/v1/metaserver":
            try:
                rdv = Rendezvous.from_json(body)
            except RendezvousError as exc:
                raise _HttpError(400, str(exc)) from None
            return self._rendezvous(rdv)
        if path == "/v1/finished":
            return self._finished(body)
        raise _HttpError(404, f"no such endpoint: POST {path}")

    def _rendezvous(self, rdv: Rendezvous) -> tuple[int, Any]:
        with self._cond:
            entry = self._subs.get(rdv.request_id)
            if entry is None:
                raise _HttpError(404, f"unknown request_id {rdv.request_id!r}")
            job, sub = entry
            if sub.rendezvous is not None and job.dispatched:
                if sub.rendezvous != rdv:
                    # Prefill already has the first one; changing it now would split the
                    # job between two Decode endpoints.
                    raise _HttpError(
                        409,
                        f"request_id {rdv.request_id!r}: a different rendezvous was "
                        "already dispatched to Prefill",
                    )
                return 200, {"status": "ok", "duplicate": True}
            # Before dispatch the latest rendezvous wins (e.g. a Decode that restarted).
            sub.rendezvous = rdv
            if all(s.rendezvous is not None for s in job.subs):  # C3: all, then once
                job.dispatched = True
                self._prefill_q.setdefault(job.prefill_instance, deque()).append(
                    {
                        "job": job.job_id,
                        "prompts": list(job.prompts),
                        "max_completion_tokens": 1,
                        "min_tokens": 1,
                        "requests": [
                            {
                                "request_id": s.request_id,
                                "prompt": s.prompt,
                                "num_tokens": s.num_tokens,
                                "kv_transfer_params": s.rendezvous.to_json(),  # type: ignore[union-attr]
                            }
                            for s in job.subs
                        ],
                    }
                )
            self._cond.notify_all()
            return 200, {"status": "ok"}

    def _finished(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict):
            raise _HttpError(400, f"body: expected a JSON object, got {type(body).__name__}")
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise _HttpError(400, "field 'request_id': expected a non-empty string")
        ok = body.get("ok")
        if not isinstance(ok, bool):
            raise _HttpError(400, "field 'ok': expected a boolean")
        role = body.get("role")
        if role not in ROLES:
            raise _HttpError(400, f"field 'role': expected one of {list(ROLES)}, got {role!r}")
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            raise _HttpError(400, "field 'error': expected a string")
        with self._cond:
            entry = self._subs.get(request_id)
            if entry is None:
                raise _HttpError(404, f"unknown request_id {request_id!r}")
            job, sub = entry
            if role == "prefill" and not job.dispatched:
                raise _HttpError(409, f"request_id {request_id!r} was never dispatched to Prefill")
            previous = sub.ok.get(role)
            if previous is not None:
                if previous != ok:
                    raise _HttpError(
                        409, f"request_id {request_id!r}: {role} already reported ok={previous}"
                    )
                return 200, {"status": "ok", "duplicate": True}
            sub.ok[role] = ok
            if error:
                sub.errors[role] = error[:4096]
            self._cond.notify_all()
            return 200, {"status": "ok"}
