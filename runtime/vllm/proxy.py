"""The D-first disaggregation proxy in front of real vLLM OpenAI servers (C1, C3, F1).

A client's ``POST /v1/completions`` goes to a Decode server first, with
``kv_transfer_params = {do_remote_prefill: true, do_remote_decode: false, metaserver: URL}``
(the upstream vllm-ascend "layerwise" shape) and a fresh ``X-Request-Id``, so vLLM names the
completion's sub-requests ``cmpl-<id>-<i>``, one per prompt of a prompt list. Decode's
connector allocates the destination blocks and posts a rendezvous
(:class:`~sfa_rd2h.runtime.metaserver.Rendezvous`, ``request_id`` = that sub-request name,
with or without vLLM's internal ``-<8 hex>`` suffix) to this proxy's ``POST /v1/metaserver``.
Once every sub-request has posted (C3), the proxy sends the completion once to a Prefill
server: the same prompt(s) in the same order under the same ``X-Request-Id`` (so both
connectors derive the same external ids), ``max_tokens=1``, and ``kv_transfer_params`` built
by :func:`prefill_params` from the rendezvous. Prefill pushes the KV layer by layer; Decode's
response is streamed back to the client.

Early dispatch (``early_dispatch=True``, the default; ``--no-early-dispatch`` turns it off):
a Decode instance's endpoint does not change between requests, and a Decode whose
rendezvous says ``keeps_local_prefix`` never writes its own prefix hit whatever Prefill
sends (C5). Once such a rendezvous came from an instance, the proxy sends each later
completion to Prefill at the same time as to that Decode, with the endpoint it learned and
``remote_cached_tokens: 0``, so Decode's admission no longer runs before Prefill's. Only
while that Decode keeps up: with the rendezvous of an earlier completion still outstanding
there (it may be short of KV blocks and queueing), or while its latest rendezvous
(``free_kv_share``, ``free_seq_slots``) and the completions ended there since (never more
slots than its ``seq_slots`` less the prompts of the completions still open there) leave
less than ``early_headroom`` of its KV blocks or fewer sequence slots than the completion
has prompts, a completion goes Decode first. The rendezvous still comes, and must name
the same endpoint and still keep its prefix: one that does not (a Decode restarted
elsewhere, or replaced by a build without C5) fails that completion, and the next is
dispatched by what it named.

Failures reach the client as HTTP errors, never a hang: a Prefill that answers an error or
cannot be reached, a rendezvous that does not complete within ``rendezvous_timeout_s``, or a
request that outlives ``request_timeout_s`` aborts the Decode request (closing its HTTP
stream; vLLM aborts a request whose client went away, so Decode frees its blocks) and the
client gets 502/504 (or, once a stream has started, an SSE error event). A Decode error is
forwarded with Decode's own status and body, and the Prefill requests still running are
cancelled.

Endpoints: ``POST /v1/completions``, ``POST /v1/metaserver`` (200 ``{"status": "ok"}`` at
once - it does not hold Decode's POST while Prefill runs -, 400 bad body, 404 unknown id,
409 a different rendezvous after dispatch; the same contract as the threaded
:class:`~sfa_rd2h.runtime.metaserver.ProxyServer`, so ``post_rendezvous`` and its F1 retry
semantics apply), ``POST /v1/metaserver/failed`` (a process that knows a sub-request's KV
will not reach Decode - a Prefill rank that gave up on its reader, S5/S7 - ends the
completion at once with that cause: 200, 400 bad body, 404 unknown id; Prefill learns the
URL from its ``kv_transfer_params["metaserver"]``), ``GET /v1/models`` (Decode's),
``GET /health`` and ``GET /healthcheck``, ``GET /v1/proxy/jobs`` (timings of recent
completions).

With a token (``token=``, ``--token-file`` or ``SFA_RD2H_METASERVER_TOKEN``) every endpoint
but the two health probes answers 401 to a caller without ``Authorization: Bearer <token>``
and changes nothing; the client's credentials then go no further than the proxy.

Run it standalone::

    python -m sfa_rd2h.runtime.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import hmac
import ipaddress
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sfa_rd2h.runtime.metaserver import TOKEN_ENV, Rendezvous, RendezvousError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0  # start(): uvicorn accepting requests
CLOSE_TIMEOUT_S = 10.0  # close(): one deadline for in-flight completions, uvicorn and its thread
CONNECT_TIMEOUT_S = 5.0  # one TCP connect to a Decode engine (a Prefill call: its deadline)
#: Every call to an engine goes on a connection of its own (``force_close``), closed when its
#: answer ends. A call sent on a pooled connection that the engine's server (uvicorn) is
#: closing that instant is reset, and neither completion call can be retried then: the engine
#: may have taken the request, and a prompt must not run twice. Expiring pooled connections before
#: uvicorn's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) narrows that window but a stall
#: between the two clocks reopens it, and a reset on a healthy Prefill was still seen under
#: load. One TCP handshake per call is the price; the client leaves one socket in TIME_WAIT
#: per call, which bounds a single engine at roughly ip_local_port_range / 60 s calls a
#: second (about 470 with Linux's defaults), far above what one engine serves.
MAX_CONNECTIONS = 4096
MODELS_TIMEOUT_S = 10.0  # the /v1/models lookup forwarded to Decode
MAX_IDLE_WAIT_S = 600.0  # the longest wait /v1/proxy/in-flight accepts
GRACEFUL_SHUTDOWN_S = 5  # uvicorn's own graceful-shutdown bound (close() lowers it to fit)
REAP_SLACK_S = 1.0  # a job nobody iterates is reaped this long after its deadline
#: How long a Decode error waits for the connector's own report of its cause: vLLM answers
#: a failed KV load with a bare "Internal server error", and the report (a few ms behind
#: it, from the connector's thread) says what failed and what to change.
REPORT_GRACE_S = 1.0

MAX_BODY_BYTES = 16 * 1024 * 1024  # token-id prompt lists are large; a request body is capped
MAX_ERROR_BODY = 64 * 1024  # how much of a backend's error body is forwarded
# vLLM 0.32 names the engine request of prompt i of a completion `cmpl-<X-Request-Id>-<i>`
# and appends `-<8 hex>` internally; a connector may post either form.
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
# Keys dropped from the Prefill copy of a request: Prefill computes the prompt's KV and one
# token, never a stream nor several sequences.
_PREFILL_DROP = ("stream_options", "min_completion_tokens", "n", "best_of")
_OPEN_PATHS = frozenset({"/health", "/healthcheck"})  # no token asked, even with one set


class ProxyError(Exception):
    """An error answered to the client with ``status`` (OpenAI error body)."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        self.status = status
        self.err_type = err_type
        super().__init__(message)


def error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    """The OpenAI/vLLM error object, so clients parse proxy errors like server errors."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def _error(status: int, message: str, err_type: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, err_type), status_code=status)


def split_prompt(prompt: Any) -> list[Any]:
    """The sub-prompts of a completion's ``prompt``: one for a string or a token-id list,
    one per element for a list of strings or of token-id lists (C3)."""

    def token_ids(value: Any) -> bool:
        return (isinstance(value, list) and bool(value)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in value))

    if isinstance(prompt, str) and prompt:
        return [prompt]
    if token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(token_ids(p) for p in prompt):
            return list(prompt)
    raise ProxyError(400, "'prompt' must be a non-empty string, a list of token ids, or a "
                          "non-empty list of those")


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/]`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL or host:port, got {url!r}")
    return url


@dataclass
class _Failure:
    status: int
    message: str
    err_type: str


@dataclass
class _Room:
    """What a Decode's latest rendezvous told of its room (C3), its slots counted up again
    as completions sent there end."""

    kv_share: float  # of its KV blocks, free
    slots: int  # sequence slots free
    seq_slots: int | None  # sequence slots in all, if told


@dataclass
class _Job:
    """One client completion: its sub-requests, their rendezvous and the backend calls."""

    xrid: str
    body: dict[str, Any]
    prompts: list[Any]
    decode: str
    prefill: str
    created: float
    deadline: float
    failure: asyncio.Future[_Failure]
    rendezvous: list[dict[str, Any] | None] = field(default_factory=list)
    parsed: list[Rendezvous | None] = field(default_factory=list)
    dispatched: bool = False
    early: dict[str, Any] | None = None  # the endpoint Prefill was sent before a rendezvous
    registered: asyncio.Event | None = None  # early: set once every rendezvous came
    admitting: bool = False  # counted among its Decode's completions awaiting a rendezvous
    ended: bool = False  # Decode's answer ended: no longer holds sequence slots there (C3)
    prefill_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    reaper: asyncio.TimerHandle | None = None
    times: dict[str, float] = field(default_factory=dict)
    outcome: str = "running"
    prefill_status: int | str | None = None  # Prefill's HTTP status, or why there was none

    @property
    def sub_ids(self) -> list[str]:
        return [f"cmpl-{self.xrid}-{i}" for i in range(len(self.prompts))]

    def fail(self, status: int, message: str, err_type: str = "ServiceUnavailableError") -> None:
        """First failure wins; everyone racing against ``failure`` wakes up."""
        if not self.failure.done():
            log.warning("proxy: completion %s failed: %s", self.xrid, message)
            self.failure.set_result(_Failure(status, message, err_type))

    def record(self) -> dict[str, Any]:
        t0 = self.created

        def ms(key: str) -> float | None:
            return None if key not in self.times else round((self.times[key] - t0) * 1e3, 2)

        # t0 on the host-wide monotonic clock, as in the connector's traces (their "t0")
        return {"id": f"cmpl-{self.xrid}", "t0": round(t0, 6), "prompts": len(self.prompts),
                "decode": self.decode, "prefill": self.prefill, "outcome": self.outcome,
                "rendezvous_ms": ms("rendezvous"), "prefill_sent_ms": ms("prefill_sent"),
                "prefill_done_ms": ms("prefill_done"),
                "decode_headers_ms": ms("decode_headers"), "done_ms": ms("done"),
                "prefill_status": self.prefill_status, "early": self.early is not None}


if hasattr(asyncio, "timeout_at"):  # Python 3.11+: a timer handle, the cheapest per token
    _timeout_at = asyncio.timeout_at
else:
    @contextlib.asynccontextmanager
    async def _timeout_at(when: float) -> AsyncIterator[None]:
        """TimeoutError at ``when`` on the running loop's clock."""
        with anyio.fail_after(max(0.0, when - asyncio.get_running_loop().time())):
            yield


class _BearerGate:
    """Every path but the health probes needs the proxy's bearer token (orchestrators probe
    health without credentials); a proxy without a token has no gate. Plain ASGI rather
    than Starlette's BaseHTTPMiddleware, which runs each request in a task of its own and
    passes every streamed chunk through a memory stream: per request and per token, on the
    proxy's one thread."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, value = given.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(),
                                                               self._token):
            await self.app(scope, receive, send)
            return
        why = "the bearer token is wrong" if given else \
            "this proxy requires a bearer token (Authorization: Bearer ...)"
        response = JSONResponse(error_body(401, why, "AuthenticationError"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class _DecodeStream(StreamingResponse):
    """Decode's body relayed to the client, cleaned up as soon as the response is over,
    however it ended. A client that leaves cancels the response wherever it is: with the
    body generator at a yield, its ``finally`` runs only when the generator is finalized,
    which left the job open long after the client had gone (``tests/test_vllm_proxy.py``);
    with the generator not yet started, it has no ``finally`` to run."""

    def __init__(self, content: AsyncIterator[bytes], *,
                 on_exit: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_exit = on_exit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A disconnect cancels this task's scope; the cleanup's awaits must still run.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._on_exit()


class DisaggProxy:
    """The proxy/metaserver as an ASGI app served by uvicorn.

    ``start()`` serves on a background thread (for tests and ``sfa-rd2h vllm-demo``) and
    returns the base URL; ``serve()`` serves on the calling thread (the command line).
    ``close(timeout)`` fails every in-flight completion with 503, stops uvicorn and joins the
    thread, all within one deadline.
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        rendezvous_timeout_s: float = 60.0,
        request_timeout_s: float = 300.0,
        prefill_retries: int = 2,
        max_body: int = MAX_BODY_BYTES,
        token: str | None = None,
        early_dispatch: bool = True,
        early_headroom: float = 0.1,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("at least one Prefill and one Decode server are required")
        if rendezvous_timeout_s <= 0 or request_timeout_s <= 0 or prefill_retries < 0:
            raise ValueError("timeouts must be > 0 and prefill_retries >= 0")
        if not 0.0 <= early_headroom <= 1.0:
            raise ValueError(f"early_headroom must lie in 0..1, got {early_headroom}")
        shown = advertise_host or host
        try:
            wildcard = ipaddress.ip_address(shown).is_unspecified
        except ValueError:
            wildcard = False  # a host name
        if wildcard:
            # Decode posts to the metaserver URL; a wildcard is not an address it can reach.
            raise ValueError(f"{shown!r} is a wildcard: pass advertise_host, the address "
                             "Decode servers reach this proxy at")
        self.prefill = [normalize_url(u) for u in prefill]
        self.decode = [normalize_url(u) for u in decode]
        self._host, self._port = host, port
        self._shown = f"[{shown}]" if ":" in shown else shown
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.request_timeout_s = request_timeout_s
        self.prefill_retries = prefill_retries
        self.max_body = max_body
        self.early_dispatch = early_dispatch
        self.early_headroom = early_headroom
        # Per Decode URL: the endpoint its latest rendezvous named, if it said
        # keeps_local_prefix (C5); what an early dispatch sends Prefill.
        self._endpoints: dict[str, dict[str, Any]] = {}
        # Per Decode URL: the room it has (C3); early dispatch only while there is room
        # for the new completion.
        self._room: dict[str, _Room] = {}
        # Per Decode URL: completions sent there whose rendezvous have not all come (its
        # admissions in progress); early dispatch only while it has none but the new one.
        self._admitting: collections.Counter[str] = collections.Counter()
        # Per Decode URL: the prompts of completions sent there whose answer has not ended,
        # each holding (or about to hold) a sequence slot (C3).
        self._open_seqs: collections.Counter[str] = collections.Counter()
        # A bearer token every caller but a health probe must present (off unless given
        # here or in SFA_RD2H_METASERVER_TOKEN); Decode's rendezvous client and the
        # connectors' failure reports send the same one. Never logged.
        self._token = (token if token is not None else os.environ.get(TOKEN_ENV)) or None
        self._rr_prefill = itertools.cycle(range(len(self.prefill)))
        self._rr_decode = itertools.cycle(range(len(self.decode)))
        self._jobs: dict[str, _Job] = {}
        self._subs: dict[str, tuple[_Job, int]] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=1024)
        # Records are written on the event loop; records() waits for them from other threads.
        self._recorded = threading.Condition()
        self._records_written = 0
        self._client: aiohttp.ClientSession | None = None
        self._idle: asyncio.Event | None = None  # set while no completion is tracked
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self.url = ""
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle

    @property
    def jobs_in_flight(self) -> int:
        """Completions the proxy still tracks (a finished run must leave none)."""
        return len(self._jobs)

    def in_flight(self) -> list[dict[str, Any]]:
        """The completions still tracked, each as its record would read now (a job that
        outlives its client says how far it got: rendezvous, Prefill's call, Decode's
        headers, the stream's end)."""
        return [{**job.record(), "dispatched": job.dispatched,
                 "prefill_pending": sum(not t.done() for t in job.prefill_tasks)}
                for job in list(self._jobs.values())]

    def records(self, at_least: int = 0, timeout: float = 0.0) -> list[dict[str, Any]]:
        """The finished completions' records (what ``/v1/proxy/jobs`` answers), once
        ``at_least`` have been written since start or ``timeout`` seconds have passed. A
        record is written when Decode's answer has ended and Prefill's own answer, which may
        trail it, has come in: a client holding its completion can still see it missing."""
        with self._recorded:
            self._recorded.wait_for(lambda: self._records_written >= at_least, timeout)
            return list(self._recent)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the proxy tracks no completion, every one's record written (Prefill's
        answer may come in after the client has its own), or ``timeout`` seconds pass; True
        if it is idle."""
        with self._recorded:
            return self._recorded.wait_for(lambda: not self._jobs, timeout)

    def cpu_seconds(self) -> float:
        """CPU seconds the serving thread has used so far (every request, relay and
        rendezvous runs on it); 0.0 unless started with :meth:`start` and running."""
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # it ended just now
            return 0.0

    @property
    def metaserver_url(self) -> str:
        """Where Decode's connector posts its rendezvous."""
        return f"{self.url}/v1/metaserver"

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # IPPROTO_TCP named, and TCP_NODELAY set (every accepted connection inherits it):
        # asyncio's own loop sets TCP_NODELAY only on a socket whose proto says TCP, and
        # without it each relayed token waited for the client's delayed ACK, ~40 ms a
        # completion (uvloop sets it on every connection; ``python -m`` ran asyncio's loop).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(512)
        sock.setblocking(False)
        self._sock = sock
        # Bound before serving, so the metaserver URL handed to Decode is known and final.
        self.url = f"http://{self._shown}:{sock.getsockname()[1]}"
        return sock

    def _uvicorn(self) -> uvicorn.Server:
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                access_log=False)
        self._server = uvicorn.Server(config)
        return self._server

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Serve on a background thread; return the base URL once it accepts requests."""
        if self._thread is not None:
            raise RuntimeError("DisaggProxy can be started once")
        sock = self._bind()
        server = self._uvicorn()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        name="sfa-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.close()
            raise TimeoutError(f"proxy did not start within {timeout}s")
        return self.url

    def serve(self) -> None:
        """Serve on this thread until interrupted (uvicorn handles signals), in the event
        loop uvicorn picks, as :meth:`start` does (uvloop where installed)."""
        sock = self._bind()
        log.warning("proxy serving on %s (metaserver %s)", self.url, self.metaserver_url)
        self._uvicorn().run(sockets=[sock])

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop serving within ``timeout`` seconds in all: in-flight completions get 503, the
        backend calls are cancelled (which aborts them on the servers), uvicorn stops."""
        deadline = time.monotonic() + timeout
        server, thread, loop = self._server, self._thread, self._loop
        if loop is not None and loop.is_running():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._begin_shutdown)
        if server is not None:
            server.config.timeout_graceful_shutdown = max(1, int(timeout / 2))
            server.should_exit = True
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic() - 1.0))
            if thread.is_alive() and server is not None:
                server.force_exit = True  # stop waiting for connections; lifespan is skipped
                thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.error("proxy: server thread still alive %.1fs after close", timeout)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> DisaggProxy:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _begin_shutdown(self) -> None:
        self._closing = True
        for job in list(self._jobs.values()):
            job.fail(503, "the proxy is shutting down")
            if job.registered is not None:
                job.registered.set()  # nobody waits for Decode's rendezvous any more
            for task in job.prefill_tasks:
                task.cancel()

    # ------------------------------------------------------------------ the app

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            self._idle = asyncio.Event()
            self._idle.set()
            # trust_env=False: an http_proxy from the environment must not divert calls to
            # the cluster's own servers (same reason as runtime.metaserver's clients).
            # aiohttp, not httpx: a third of httpx's CPU per call on this thread, which
            # relays every stream and serves every rendezvous. Decode's body is relayed as
            # it came (asked for uncompressed, never decompressed); each read may wait
            # request_timeout_s, as the deadline is raced on its own.
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=MAX_CONNECTIONS),
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S,
                                              sock_read=self.request_timeout_s),
                auto_decompress=False, trust_env=False)
            self._started.set()
            try:
                yield
            finally:
                self._begin_shutdown()
                await self._client.close()

        app = FastAPI(lifespan=lifespan, title="sfa-rd2h D-first proxy")

        if self._token is not None:
            app.add_middleware(_BearerGate, token=self._token)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            try:
                return await self._completions(request)
            except ProxyError as exc:
                return _error(exc.status, str(exc), exc.err_type)

        @app.post("/v1/metaserver")
        async def metaserver(request: Request) -> Response:
            try:
                body = json.loads(await request.body())
                rdv = Rendezvous.from_json(body)
            except (ValueError, RendezvousError) as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            status, payload = self._rendezvous(rdv, body)
            return JSONResponse(payload, status_code=status)

        @app.post("/v1/metaserver/failed")
        async def failed(request: Request) -> Response:
            try:
                body = json.loads(await request.body())
                request_id, error, reporter = _failure_report(body)
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            status, payload = self._kv_failed(request_id, error, reporter)
            return JSONResponse(payload, status_code=status)

        @app.get("/v1/models")
        async def models() -> Response:
            assert self._client is not None
            try:
                async with self._client.get(
                        f"{self.decode[0]}/v1/models",
                        timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as resp:
                    content = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                return _error(502, f"decode {self.decode[0]} unreachable: "
                                   f"{_describe(exc)}", "BadGateway")
            return Response(content, status_code=resp.status,
                            media_type=resp.headers.get("content-type"))

        @app.get("/health")
        @app.get("/healthcheck")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "prefill_instances": len(self.prefill),
                    "decode_instances": len(self.decode)}

        @app.get("/v1/proxy/jobs")
        async def jobs() -> list[dict[str, Any]]:
            return self.records()

        @app.get("/v1/proxy/in-flight")
        async def in_flight(wait: float = 0.0) -> list[dict[str, Any]]:
            # What a caller in another process (vllm-bench) asks after a load: the
            # completions still tracked, once there are none or ``wait`` seconds passed.
            assert self._idle is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), min(max(wait, 0.0), MAX_IDLE_WAIT_S))
            return self.in_flight()

        return app

    # ------------------------------------------------------------------ completions

    async def _completions(self, request: Request) -> Response:
        raw = await request.body()
        if len(raw) > self.max_body:
            raise ProxyError(413, f"body of {len(raw)} bytes exceeds {self.max_body}")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ProxyError(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            raise ProxyError(400, "kv_transfer_params are set by the proxy, not the client")
        if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1) \
                or body.get("use_beam_search"):
            # One KV transfer serves one sequence per prompt.
            raise ProxyError(400, "n, best_of and beam search must be 1 / off behind the "
                                  "disaggregation proxy")
        prompts = split_prompt(body.get("prompt"))
        if self._closing:
            raise ProxyError(503, "the proxy is shutting down", "ServiceUnavailableError")
        job = self._new_job(body, prompts)
        try:
            return await self._run(job, request)
        except BaseException:
            self._close_job(job, "error", cancel_prefill=True)
            raise

    def _new_job(self, body: dict[str, Any], prompts: list[Any]) -> _Job:
        loop = asyncio.get_running_loop()
        now = loop.time()
        job = _Job(
            xrid=uuid.uuid4().hex, body=body, prompts=prompts,
            decode=self.decode[next(self._rr_decode)],
            prefill=self.prefill[next(self._rr_prefill)],
            created=now, deadline=now + self.request_timeout_s,
            failure=loop.create_future(),
            rendezvous=[None] * len(prompts), parsed=[None] * len(prompts))
        self._jobs[job.xrid] = job
        if self._idle is not None:
            self._idle.clear()
        for i, sub in enumerate(job.sub_ids):
            self._subs[sub] = (job, i)
        job.admitting = True
        self._admitting[job.decode] += 1
        self._open_seqs[job.decode] += len(prompts)
        job.timer = loop.call_later(self.rendezvous_timeout_s, self._rendezvous_expired, job)
        # Backstop for a response that is never iterated (client gone before the body
        # started): nothing is registered past the deadline.
        job.reaper = loop.call_at(job.deadline + REAP_SLACK_S, self._reap, job)
        return job

    def _reap(self, job: _Job) -> None:
        job.fail(504, "request deadline passed", "GatewayTimeout")
        self._close_job(job, "reaped at the deadline", cancel_prefill=True)

    def _rendezvous_expired(self, job: _Job) -> None:
        if not job.dispatched:
            got = sum(r is not None for r in job.parsed)
            job.fail(504, f"only {got} of {len(job.prompts)} sub-requests posted a rendezvous "
                          f"within {self.rendezvous_timeout_s}s (C3); decode {job.decode} "
                          f"posts them to {self.metaserver_url}: if it cannot reach that "
                          "address, start the proxy with --advertise-host set to one it "
                          "reaches", "GatewayTimeout")

    async def _run(self, job: _Job, request: Request) -> Response:
        assert self._client is not None
        loop = asyncio.get_running_loop()
        d_body = dict(job.body)
        d_body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                        "metaserver": self.metaserver_url}
        d_task = asyncio.ensure_future(self._open(
            f"{job.decode}/v1/completions", d_body, self._headers(request, job.xrid)))
        self._dispatch_early(job)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            done, _ = await asyncio.wait({d_task, job.failure, gone},
                                         timeout=max(0.0, job.deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if d_task not in done:
            await self._decode_registered(job, d_task)
            # Cancelling the call closes the connection: vLLM aborts the request on Decode.
            d_task.cancel()
            resp = await _settle(d_task)
            if resp is not None:
                resp.close()
            if gone in done:
                self._close_job(job, "client gone", cancel_prefill=True)
                return Response(status_code=499)
            job.fail(504, f"no answer from decode {job.decode} within "
                          f"{self.request_timeout_s}s", "GatewayTimeout")
            failure = job.failure.result()
            self._close_job(job, failure.message, cancel_prefill=True)
            return _error(failure.status, failure.message, failure.err_type)
        try:
            resp = d_task.result()
        except (aiohttp.ClientError, TimeoutError) as exc:
            message = f"decode {job.decode} unreachable: {_describe(exc)}"
            job.fail(502, message, "BadGateway")
            self._close_job(job, message, cancel_prefill=True)
            return _error(502, message, "BadGateway")
        job.times["decode_headers"] = loop.time()
        if resp.status != 200:
            try:
                data = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                data = json.dumps(error_body(502, f"decode {job.decode} answered "
                                             f"{resp.status}, body lost: {_describe(exc)}",
                                             "BadGateway")).encode()
            finally:
                resp.close()
            reported = await self._reported_cause(job, resp.status)
            if reported is not None:
                message = (f"{reported.message} (decode answered {resp.status}: "
                           f"{_error_message(data)})")
                self._close_job(job, message, cancel_prefill=True)
                # the reported status, as when the report overtakes Decode's answer
                return _error(reported.status, message, reported.err_type)
            job.fail(resp.status, f"decode answered {resp.status}")
            self._close_job(job, f"decode {resp.status}", cancel_prefill=True)
            if resp.status >= 500 and not any(job.parsed):
                # Decode gave up before any rendezvous reached us (vLLM words a failed load
                # "Internal server error"): most likely the one address it was given here
                # (C1) does not work from there. Say so, with Decode's own words.
                message = (f"decode {job.decode} answered {resp.status} "
                           f"({_error_message(data)}) before posting any rendezvous to "
                           f"{self.metaserver_url}: if Decode cannot reach that address, "
                           "start the proxy with --advertise-host set to one it reaches")
                log.warning("proxy: %s", message)
                return _error(resp.status, message, "BadGateway")
            return Response(data[:MAX_ERROR_BODY], status_code=resp.status,
                            media_type=resp.headers.get("content-type", "application/json"))
        streaming = bool(job.body.get("stream"))
        return _DecodeStream(self._forward(job, resp, streaming),
                             on_exit=lambda: self._end_stream(job, resp, "client gone"),
                             status_code=200, media_type=resp.headers.get("content-type"))

    async def _open(self, url: str, body: dict[str, Any],
                    headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST ``body`` to an engine; the response once its headers are in (its body is
        read by the caller, who closes it)."""
        assert self._client is not None
        return await self._client.post(url, data=_json(body),
                                       headers={**headers, **_ENGINE_HEADERS})

    async def _end_stream(self, job: _Job, resp: aiohttp.ClientResponse,
                          outcome: str) -> None:
        """Close Decode's stream (which aborts the request there if it is still running)
        and the job, once: from ``_forward``'s cleanup, or when the client's response ended
        without it (a response cancelled before its body began), instead of at the reaper
        a deadline later."""
        if "done" in job.times:
            return
        if outcome != "ok":
            # Also from a cancelled stream's cleanup: this wait is bounded, not cancelled.
            with anyio.CancelScope(shield=True):
                await self._decode_registered(job)
        resp.close()
        job.times["done"] = asyncio.get_running_loop().time()
        # Decode answered: Prefill calls still running (its 1-token answer can trail
        # Decode's) finish on their own, bounded by the deadline; on a failure they are
        # no longer needed.
        self._close_job(job, outcome, cancel_prefill=outcome != "ok")

    async def _reported_cause(self, job: _Job, status: int) -> _Failure | None:
        """After Decode answered ``status`` >= 500 for a dispatched completion: the cause a
        process reported (``/v1/metaserver/failed``), waiting ``REPORT_GRACE_S`` for it."""
        if status < 500 or not job.dispatched:
            return None
        if not job.failure.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(job.failure), REPORT_GRACE_S)
        return job.failure.result() if job.failure.done() else None

    async def _forward(self, job: _Job, resp: aiohttp.ClientResponse,
                       streaming: bool) -> AsyncIterator[bytes]:
        """Decode's body, chunk by chunk. Until the first chunk a failure (e.g. Prefill
        failed, so the KV never comes) ends the stream with an error event; after it, the KV
        has landed and Decode's answer stands."""
        loop = asyncio.get_running_loop()
        chunks = resp.content.iter_any()
        outcome = "ok"
        first = not streaming  # a non-streamed 200 is already Decode's final answer
        nxt: asyncio.Future[bytes] | None = None
        try:
            while True:
                failure: _Failure | None = None
                try:
                    if first:
                        # The KV has landed and Decode's answer stands: only the deadline is
                        # raced now, in place (a task and a wait per token cost the proxy's
                        # thread more than relaying the token does).
                        async with _timeout_at(job.deadline):
                            chunk = await chunks.__anext__()
                    else:
                        nxt = asyncio.ensure_future(chunks.__anext__())
                        done, _ = await asyncio.wait(
                            {nxt, job.failure}, timeout=max(0.0, job.deadline - loop.time()),
                            return_when=asyncio.FIRST_COMPLETED)
                        if nxt in done:
                            chunk = nxt.result()
                        else:
                            nxt.cancel()
                            await _settle(nxt)
                            if not job.failure.done():
                                raise TimeoutError
                            failure = job.failure.result()
                except StopAsyncIteration:
                    break
                except aiohttp.ClientError as exc:
                    outcome = f"decode stream broke: {_describe(exc)}"
                    yield _sse_error(502, outcome, "BadGateway")
                    break
                except TimeoutError:
                    failure = _Failure(504, "request deadline passed", "GatewayTimeout")
                except asyncio.CancelledError:
                    outcome = "client gone"  # Starlette cancelled the read: the client left
                    raise
                if failure is None and not first and chunk.startswith(b'data: {"error"'):
                    # vLLM's bare error event for a failed load: prefer the reported cause
                    failure = await self._reported_cause(job, 500)
                if failure is not None:
                    outcome = failure.message
                    yield _sse_error(failure.status, failure.message, failure.err_type)
                    break
                first = True
                yield chunk
        except GeneratorExit:
            # closed while suspended at a yield: the client left mid-stream
            outcome = "client gone"
            raise
        finally:
            if nxt is not None and not nxt.done():
                # The client left mid-stream (Starlette cancelled this generator): closing
                # Decode's stream below may fail the pending read, which nobody awaits any
                # more - retrieve it here instead of "Task exception was never retrieved" in
                # the log.
                nxt.add_done_callback(_retrieve)
                nxt.cancel()
                outcome = "client gone"
            await self._end_stream(job, resp, outcome)

    def _headers(self, request: Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("authorization")
        if auth and self._token is None:
            # Without a token of its own the client's credentials are the engines' (vLLM's
            # --api-key); with one, they are this proxy's and go no further.
            headers["Authorization"] = auth
        return headers

    def _close_job(self, job: _Job, outcome: str, *, cancel_prefill: bool) -> None:
        if self._jobs.get(job.xrid) is not job:
            return
        if job.timer is not None:
            job.timer.cancel()
        job.outcome = outcome
        if not job.ended:
            # Decode's answer has ended (or was given up): the sequence slots its
            # sub-requests held there are free again, also if told before they ended.
            job.ended = True
            self._open_seqs[job.decode] -= len(job.prompts)
            if not self._open_seqs[job.decode]:
                del self._open_seqs[job.decode]
            room = self._room.get(job.decode)
            if room is not None and not job.admitting:
                room.slots += len(job.prompts)
        pending = [t for t in job.prefill_tasks if not t.done()]
        if cancel_prefill:
            for task in pending:
                task.cancel()
        if pending and not cancel_prefill:
            # Keep the rendezvous routable until Prefill answered (a retried POST from a
            # slow Decode must not see 404 while its request is still being served).
            gathered = asyncio.gather(*pending, return_exceptions=True)
            gathered.add_done_callback(lambda _: self._forget(job))
        else:
            self._forget(job)

    def _forget(self, job: _Job) -> None:
        # One step for a waiter in records() or wait_idle(): no job in flight means every
        # record written.
        with self._recorded:
            if self._jobs.pop(job.xrid, None) is None:
                return
            if job.reaper is not None:
                job.reaper.cancel()
            for sub in job.sub_ids:
                self._subs.pop(sub, None)
            self._admitted(job)
            self._recent.append(job.record())
            self._records_written += 1
            self._recorded.notify_all()
        if not self._jobs and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ metaserver

    def _find(self, request_id: str) -> tuple[_Job, int] | None:
        hit = self._subs.get(request_id)
        if hit is None and (m := _INTERNAL_SUFFIX.search(request_id)):
            hit = self._subs.get(request_id[: m.start()])
        return hit

    def _rendezvous(self, rdv: Rendezvous, raw: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        hit = self._find(rdv.request_id)
        if hit is None:
            return 404, {"error": f"unknown request_id {rdv.request_id!r}"}
        job, i = hit
        if job.early is not None and job.parsed[i] is None:
            # Decode registered it, also if the completion failed meanwhile: whoever waits
            # to close Decode's call must learn it (_decode_registered).
            return self._early_rendezvous(job, i, rdv)
        if job.failure.done():
            return _already_failed(job, rdv)
        self._learn_endpoint(job, rdv)
        if job.dispatched:
            if job.parsed[i] != rdv:
                # Prefill already has the first one; changing it now would split the request
                # between two Decode endpoints.
                return 409, {"error": f"request_id {rdv.request_id!r}: a different rendezvous "
                                      "was already dispatched to Prefill"}
            return 200, {"status": "ok", "duplicate": True}
        problem = loopback_across_hosts(rdv.remote_host, job.decode, job.prefill)
        if problem is not None:
            job.fail(502, problem, "BadGateway")
            return 409, {"error": problem}
        # Before dispatch the latest rendezvous wins (e.g. a Decode that retried).
        job.parsed[i] = rdv
        # Unknown keys travel on to Prefill (W4-style extension); the validated ones win.
        job.rendezvous[i] = {**raw, **rdv.to_json()}
        if all(p is not None for p in job.parsed):  # C3: every sub-request, then once
            self._every_rendezvous_came(job)
            self._dispatch(job)
        return 200, {"status": "ok"}

    def _every_rendezvous_came(self, job: _Job) -> None:
        job.times["rendezvous"] = asyncio.get_running_loop().time()
        self._admitted(job)
        if job.registered is not None:
            job.registered.set()

    def _admitted(self, job: _Job) -> None:
        """The completion no longer counts as awaiting its Decode's admission."""
        if job.admitting:
            job.admitting = False
            self._admitting[job.decode] -= 1
            if not self._admitting[job.decode]:
                del self._admitting[job.decode]

    def _dispatch(self, job: _Job) -> None:
        """Send the completion to Prefill, once."""
        loop = asyncio.get_running_loop()
        job.dispatched = True
        if job.timer is not None:
            job.timer.cancel()
        job.prefill_tasks = [asyncio.ensure_future(self._prefill(job))]
        job.prefill_tasks[0].add_done_callback(
            lambda _: job.times.setdefault("prefill_done", loop.time()))

    def _learn_endpoint(self, job: _Job, rdv: Rendezvous) -> None:
        """Remember the endpoint of a Decode that keeps its local prefix (C5), for the
        completions dispatched early to it, and the room it told; forget either once a
        rendezvous does not say it."""
        told = (None if rdv.free_kv_share is None or rdv.free_seq_slots is None
                else _Room(rdv.free_kv_share, rdv.free_seq_slots, rdv.seq_slots))
        for known, value in ((self._endpoints, _endpoint_of(rdv) if rdv.keeps_local_prefix
                              else None), (self._room, told)):
            if value is None:
                known.pop(job.decode, None)
            else:
                known[job.decode] = value

    def _has_room(self, job: _Job) -> bool:
        """Decode can admit this completion at once, as far as its latest rendezvous and
        the completions ended there since tell: at least ``early_headroom`` of its KV
        blocks free and a sequence slot per prompt, of the slots its ``seq_slots`` leaves
        beside the other completions still open there."""
        room = self._room.get(job.decode)
        if room is None or room.kv_share < self.early_headroom:
            return False
        free = room.slots
        if room.seq_slots is not None:
            # A completion whose end reaches this proxy just after a later admission's
            # rendezvous was counted free by that rendezvous and again by its end; the
            # completions still open there bound the count from above (other clients of
            # that Decode are seen only through what it tells).
            free = min(free, room.seq_slots - self._open_seqs[job.decode] + len(job.prompts))
        return free >= len(job.prompts)

    def _dispatch_early(self, job: _Job) -> None:
        """C3, early: Prefill gets the completion now, with the endpoint this Decode named
        before and ``remote_cached_tokens: 0`` (it has not said its prefix hit yet; it
        keeps its own prefix whatever Prefill sends, C5)."""
        # Not while that Decode has yet to admit a completion sent before, nor once its
        # latest admission left it short of KV blocks or sequence slots: a request it
        # cannot admit at once would keep Prefill's READYs waiting (its slots, every later
        # step) until destination_wait and then fail (C1), where Decode first just queues it.
        keeping_up = self._admitting[job.decode] <= 1 and self._has_room(job)  # counted too
        known = self._endpoints.get(job.decode) if self.early_dispatch and keeping_up else None
        if known is None or loopback_across_hosts(str(known["remote_host"]), job.decode,
                                                  job.prefill) is not None:
            return
        job.early = known
        job.registered = asyncio.Event()
        job.rendezvous = [{**known, "request_id": sub, "do_remote_prefill": False,
                           "do_remote_decode": True, "remote_cached_tokens": 0}
                          for sub in job.sub_ids]
        self._dispatch(job)

    def _early_rendezvous(self, job: _Job, i: int, rdv: Rendezvous) -> tuple[int, dict[str, Any]]:
        """The rendezvous of a sub-request Prefill already has: Decode has registered it,
        and it must name the endpoint Prefill was given, or Prefill's READYs go where this
        Decode is not."""
        job.parsed[i] = rdv
        if all(p is not None for p in job.parsed):
            self._every_rendezvous_came(job)
        # What it tells holds whatever became of the completion: its slots are counted
        # free again when it ends (it was admitted), so the room must be the one told with
        # it taken, and a Decode restarted elsewhere must be known before the next early one.
        self._learn_endpoint(job, rdv)
        if job.failure.done():
            return _already_failed(job, rdv)
        named = _endpoint_of(rdv)
        if named != job.early or not rdv.keeps_local_prefix:
            message = (f"decode {job.decode} named endpoint {named} for "
                       f"{rdv.request_id}, but prefill {job.prefill} was already sent "
                       f"{job.early} (early dispatch, C3) and a Decode that keeps its "
                       f"local prefix (C5: {rdv.keeps_local_prefix}): the Decode instance "
                       "changed (restarted?)")
            job.fail(502, message, "BadGateway")
            return 409, {"error": message}
        return 200, {"status": "ok"}

    async def _decode_registered(self, job: _Job,
                                 decode_call: asyncio.Future[Any] | None = None) -> None:
        """Before a completion dispatched early stops Decode's call unfinished (the client
        left, a failure): wait until Decode posted every rendezvous, bounded by the
        rendezvous timeout and the deadline, or until its call ended otherwise. Prefill may
        already have sent READYs for it, and a request closed before Decode's engine saw it
        is never registered there, so those READYs would hold Prefill's slots until
        Decode's ``destination_wait`` ran out (C1). Registered, it is aborted as usual and
        the READYs are answered."""
        if job.registered is None or job.registered.is_set() or self._closing:
            return
        loop = asyncio.get_running_loop()
        until = min(loop.time() + self.rendezvous_timeout_s, job.deadline)
        registered = asyncio.ensure_future(job.registered.wait())
        waiters: set[asyncio.Future[Any]] = {registered}
        if decode_call is not None:
            waiters.add(decode_call)
        try:
            done, _ = await asyncio.wait(waiters, timeout=max(0.0, until - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if decode_call in done and not registered.done() and _streaming_ok(decode_call):
                # Decode's stream began; its engine may not have the request yet.
                await asyncio.wait({registered}, timeout=max(0.0, until - loop.time()))
        finally:
            registered.cancel()

    def _kv_failed(self, request_id: str, error: str,
                   reporter: str) -> tuple[int, dict[str, Any]]:
        """A process that knows a sub-request's KV will not reach Decode said so: the
        completion fails now (the client's error names the cause) rather than when Decode's
        request deadline passes (R1); closing Decode's stream aborts it there."""
        hit = self._find(request_id)
        if hit is None:
            return 404, {"error": f"unknown request_id {request_id!r}"}
        job, _ = hit
        job.fail(502, f"the KV of {request_id} will not reach decode {job.decode} "
                      f"(reported by {reporter}): {error}", "BadGateway")
        return 200, {"status": "ok"}

    def _prefill_body(self, job: _Job) -> dict[str, Any]:
        body = {k: v for k, v in job.body.items() if k not in _PREFILL_DROP}
        params = prefill_params(job.rendezvous)  # type: ignore[arg-type]
        # Where Prefill reports a request whose KV it cannot deliver (runtime.vllm.failures).
        params["metaserver"] = self.metaserver_url
        body.update(max_tokens=1, min_tokens=1, stream=False, kv_transfer_params=params)
        if "max_completion_tokens" in job.body:
            body["max_completion_tokens"] = 1
        return body

    async def _prefill(self, job: _Job) -> None:
        """The completion's one Prefill call: the client's prompt(s) in the client's order,
        under Decode's ``X-Request-Id``, so vLLM names every sub-request on Prefill as it did
        on Decode (``cmpl-<id>-<i>``) and both connectors derive the same external ids."""
        assert self._client is not None
        loop = asyncio.get_running_loop()
        url = f"{job.prefill}/v1/completions"
        try:
            body = self._prefill_body(job)
        except ValueError as exc:
            job.fail(502, str(exc), "BadGateway")
            return
        for attempt in range(self.prefill_retries + 1):
            remaining = job.deadline - loop.time()
            if remaining <= 0:
                job.fail(504, f"prefill {job.prefill}: deadline passed", "GatewayTimeout")
                return
            job.prefill_status = f"attempt {attempt + 1} sent"
            job.times.setdefault("prefill_sent", loop.time())
            try:
                # Bounded by the deadline only, the connect included: a connect that rides
                # out a short link cut (its SYN resent after 1 s, 3 s, 7 s) must not fail a
                # completion Prefill can still serve.
                async with self._client.post(
                        url, data=_json(body),
                        headers={"X-Request-Id": job.xrid, **_ENGINE_HEADERS},
                        timeout=aiohttp.ClientTimeout(total=remaining)) as resp:
                    status, answer = resp.status, await resp.read()
            except aiohttp.ClientConnectorError as exc:
                job.prefill_status = _describe(exc)
                # Not connected means not delivered: retrying cannot run the prompt twice.
                if attempt < self.prefill_retries:
                    log.info("proxy: prefill %s attempt %d: %s", url, attempt + 1, exc)
                    await asyncio.sleep(0.05 * 2 ** attempt)  # backoff, not a wait for state
                    continue
                job.fail(502, f"prefill {job.prefill} unreachable: {exc}", "BadGateway")
                return
            except (aiohttp.ClientError, TimeoutError) as exc:
                job.prefill_status = _describe(exc)
                job.fail(502, f"prefill {job.prefill} failed: {_describe(exc)}", "BadGateway")
                return
            job.prefill_status = status
            if status != 200:
                job.fail(502, f"prefill {job.prefill} answered {status}: "
                              f"{answer[:500].decode('utf-8', 'replace')}", "BadGateway")
            return


# The fields that name the Decode endpoint: one completion is served by one Decode instance,
# so every sub-request's rendezvous carries the same ones.
_ENDPOINT_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
                  "remote_pcp_size", "remote_dcp_size")


def _endpoint_of(rdv: Rendezvous) -> dict[str, Any]:
    wire = rdv.to_json()
    return {key: wire[key] for key in _ENDPOINT_KEYS}


def prefill_params(rendezvous: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``kv_transfer_params`` of a completion's Prefill call, from its sub-requests'
    rendezvous (in prompt order).

    One prompt: exactly the rendezvous Decode posted. A prompt list shares one
    ``kv_transfer_params`` among its sub-requests on Prefill, so the flat fields are the
    common endpoint plus the smallest ``remote_cached_tokens`` (sending a block Decode
    already holds is harmless, skipping one it needs is not), and ``rendezvous`` maps each
    sub-request's ``request_id`` to its own rendezvous for a connector that reads it.
    ``ValueError`` if the sub-requests name different Decode endpoints.
    """
    first = dict(rendezvous[0])
    if len(rendezvous) == 1:
        return first
    for r in rendezvous[1:]:
        for key in _ENDPOINT_KEYS:
            if r.get(key) != first.get(key):
                raise ValueError(
                    f"sub-requests of one completion posted different Decode endpoints "
                    f"({key}: {first.get(key)!r} vs {r.get(key)!r})")
    first["remote_cached_tokens"] = min(int(r.get("remote_cached_tokens") or 0)
                                        for r in rendezvous)
    first["rendezvous"] = {str(r["request_id"]): dict(r) for r in rendezvous}
    return first


def _host_of(url: str) -> str:
    return (urllib.parse.urlsplit(url).hostname or "").lower()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_across_hosts(remote_host: str, decode_url: str, prefill_url: str) -> str | None:
    """Why a rendezvous cannot be right, or None: Decode advertised a loopback address
    while the proxy reaches it, and Prefill, at other addresses - Prefill would dial its own
    host and wait for a handshake that never comes (S5, after ``handshake_timeout``)."""
    decode_host, prefill_host = _host_of(decode_url), _host_of(prefill_url)
    if not _is_loopback(remote_host) or _is_loopback(decode_host) \
            or decode_host == prefill_host:
        return None
    return (f"decode {decode_url} advertised remote_host={remote_host!r}, a loopback "
            f"address, to Prefill {prefill_url} on another host: set `host` in the Decode "
            "connector's kv_connector_extra_config to an address Prefill reaches")


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _settle(task: asyncio.Future[Any]) -> Any:
    """Wait for a cancelled task to unwind; its result if it finished first, else None."""
    try:
        return await task
    except (asyncio.CancelledError, Exception):  # only unwinding here; the caller decides
        return None


# Every call to an engine sends JSON and takes its answer uncompressed, to relay it as is.
_ENGINE_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


def _json(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _describe(exc: BaseException) -> str:
    """An aiohttp failure in words: its type, and its message where it has one (a timeout
    has none)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(data: bytes) -> str:
    """The message of an OpenAI error body, else its first bytes."""
    try:
        return str(json.loads(data)["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace")


def _failure_report(body: Any) -> tuple[str, str, str]:
    """``(request_id, error, reporter)`` of a ``POST /v1/metaserver/failed`` body."""
    if not isinstance(body, dict):
        raise ValueError("a failure report must be a JSON object")
    fields = []
    for name, limit in (("request_id", 256), ("error", 4000), ("reporter", 256)):
        value = body.get(name, "" if name == "reporter" else None)
        if not isinstance(value, str) or (name != "reporter" and not value):
            raise ValueError(f"{name!r} must be a non-empty string")
        fields.append(value[:limit])
    return fields[0], fields[1], fields[2] or "an unnamed reporter"


def _already_failed(job: _Job, rdv: Rendezvous) -> tuple[int, dict[str, Any]]:
    return 409, {"error": f"request_id {rdv.request_id!r}: the completion already failed: "
                          f"{job.failure.result().message}"}


def _streaming_ok(call: asyncio.Future[Any]) -> bool:
    """Whether a finished Decode call gave a 200 response (a stream that may go on)."""
    if call.cancelled() or call.exception() is not None:
        return False
    return getattr(call.result(), "status", None) == 200


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned read's outcome as seen (it is the client's leaving, not a bug)."""
    if not task.cancelled():
        task.exception()


def _sse_error(status: int, message: str, err_type: str) -> bytes:
    # vLLM's own mid-stream error shape: an error event, then [DONE].
    return (f"data: {json.dumps(error_body(status, message, err_type))}\n\n"
            "data: [DONE]\n\n").encode()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sfa_rd2h.runtime.vllm.proxy",
        description="D-first disaggregation proxy and metaserver in front of vLLM servers.")
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--advertise-host", default=None,
                        help="address Decode servers reach this proxy at (required with a "
                             "wildcard --host)")
    parser.add_argument("--prefill", nargs="+", required=True, help="Prefill server URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="Decode server URLs")
    parser.add_argument("--rendezvous-timeout", type=float, default=60.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--no-early-dispatch", action="store_true",
                        help="send Prefill each completion only once Decode's rendezvous "
                             "came, never with the endpoint learned from earlier ones")
    parser.add_argument("--early-headroom", type=float, default=0.1, metavar="F",
                        help="early dispatch to a Decode only while its latest rendezvous "
                             "left at least this share of its KV blocks free, and a sequence "
                             "slot for each prompt (default 0.1)")
    parser.add_argument("--token-file", default=None,
                        help="a file holding the bearer token every caller but /health must "
                             f"send (default: ${TOKEN_ENV}, else none)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.early_headroom <= 1.0:
        parser.error(f"--early-headroom {args.early_headroom}: must lie in 0..1")
    token = None
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="ascii") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"--token-file {args.token_file}: cannot be read: {exc}")
        if not token:
            parser.error(f"--token-file {args.token_file} is empty")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    proxy = DisaggProxy(args.prefill, args.decode, host=args.host, port=args.port,
                        advertise_host=args.advertise_host,
                        rendezvous_timeout_s=args.rendezvous_timeout,
                        request_timeout_s=args.request_timeout, token=token,
                        early_dispatch=not args.no_early_dispatch,
                        early_headroom=args.early_headroom)
    # Leave the start-up heap (imports: about 60k objects) out of every later collection,
    # as vLLM's servers do: a full collection holds every stream in flight while it walks.
    gc.collect()
    gc.freeze()
    proxy.serve()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
