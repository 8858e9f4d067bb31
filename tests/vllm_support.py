"""Fake vLLM Prefill and Decode servers for the proxy tests (no engine, no model).

They speak the part of the OpenAI ``/v1/completions`` API the proxy uses and play the
connector's part of the D-first flow: the fake Decode posts one rendezvous per prompt to the
metaserver URL it was given (with the project's own ``post_rendezvous``, F1) and answers once
the fake Prefill has "pushed" that prompt's KV; it watches for its client going away, as vLLM
does, so a test can see that the proxy aborted it. Import after
``pytest.importorskip("vllm")``: FastAPI and uvicorn come with vLLM.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sfa_rd2h.runtime.metaserver import Rendezvous, post_rendezvous
from sfa_rd2h.runtime.vllm.failures import FailureReporter
from sfa_rd2h.runtime.vllm.proxy import split_prompt


class AppServer:
    """An ASGI app served by uvicorn on a background thread on a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(5.0)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(5.0)
        self._sock.close()


def fake_tokens(prompt: Any, n: int) -> list[int]:
    """What the fake servers "generate": a function of the prompt, so a test can tell
    whose answer reached the client."""
    base = sum(prompt) if isinstance(prompt, list) else len(prompt)
    return [(base + k) % 512 for k in range(n)]


async def client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@dataclass
class Backends:
    """Shared state of one fake Decode and one fake Prefill; tests set the ``*_mode``s."""

    # ok | no_rendezvous | error | read_failed (reports its cause, then vLLM's bare error)
    decode_mode: str = "ok"
    prefill_mode: str = "ok"  # ok | error | lost (200, no KV, then a failure report)
    rendezvous_gap_s: float = 0.0  # between a prompt list's posts (staggered allocation)
    post_internal_ids: bool = False  # post vLLM's internal ids (with the -<8 hex> suffix)
    cached_tokens: tuple[int, ...] = ()  # remote_cached_tokens per prompt (default 0)
    keeps_local_prefix: bool = False  # what the rendezvous says (C5): early dispatch
    # the room the rendezvous tells (C3): early dispatch needs both
    free_kv_share: float | None = 1.0
    free_seq_slots: int | None = 16
    seq_slots: int | None = 16
    decode_port: int = 20000  # the base port the rendezvous names
    decode_wait_s: float = 10.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    kv: dict[str, threading.Event] = field(default_factory=dict)
    decode_calls: list[dict[str, Any]] = field(default_factory=list)
    prefill_calls: list[dict[str, Any]] = field(default_factory=list)
    posted: list[tuple[str, int]] = field(default_factory=list)  # (request_id, status)
    posted_cond: threading.Condition = field(default_factory=threading.Condition)
    posts_started: int = 0
    decode_cancelled: threading.Event = field(default_factory=threading.Event)
    decode_arrived: threading.Event = field(default_factory=threading.Event)
    prefill_arrived: threading.Event = field(default_factory=threading.Event)
    # cleared by a test that must see Prefill called before Decode's rendezvous: the fake
    # Decode posts only once this is set
    rendezvous_gate: threading.Event = field(
        default_factory=lambda: _set(threading.Event()))
    # cleared by a test that must act while the request is still open on Decode: the fake
    # Decode then answers only once the KV landed *and* this is set
    decode_release: threading.Event = field(
        default_factory=lambda: _set(threading.Event()))
    # cleared by a test that needs a stream paused mid-way, as vLLM's is between two
    # tokens: the fake Decode streams the first token, the rest once this is set
    decode_rest: threading.Event = field(
        default_factory=lambda: _set(threading.Event()))
    # cleared by a test whose Prefill must answer after Decode: the fake Prefill pushes the
    # KV at once but sends its own 1-token answer only once this is set
    prefill_answer: threading.Event = field(
        default_factory=lambda: _set(threading.Event()))
    decode: AppServer | None = None
    prefill: AppServer | None = None
    reporter: FailureReporter = field(
        default_factory=lambda: FailureReporter("fake prefill", timeout=5.0))

    def wait_posted(self, n: int, timeout: float) -> bool:
        """Until the fake Decode has posted ``n`` rendezvous (and had each answered)."""
        with self.posted_cond:
            return self.posted_cond.wait_for(lambda: len(self.posted) >= n, timeout)

    def event(self, request_id: str) -> threading.Event:
        with self.lock:
            return self.kv.setdefault(request_id, threading.Event())

    def start(self) -> Backends:
        self.decode = AppServer(self._decode_app())
        self.prefill = AppServer(self._prefill_app())
        return self

    def close(self) -> None:
        self.decode_release.set()
        self.decode_rest.set()
        with self.lock:  # release fake-Decode threads still waiting for KV
            for ev in self.kv.values():
                ev.set()
        for server in (self.decode, self.prefill):
            if server is not None:
                server.close()
        self.reporter.close(5.0)

    # -------------------------------------------------------------- fake Decode

    def _decode_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            xrid = request.headers["x-request-id"]
            self.decode_calls.append({"body": body, "x_request_id": xrid,
                                      "authorization": request.headers.get("authorization"),
                                      "accept_encoding": request.headers.get("accept-encoding")})
            self.decode_arrived.set()
            work = asyncio.ensure_future(self._decode(body, xrid))
            gone = asyncio.ensure_future(client_gone(request))
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:  # vLLM aborts a request whose client went away
                work.cancel()
                self.decode_cancelled.set()
                return Response(status_code=499)
            gone.cancel()
            return work.result()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        return app

    async def _decode(self, body: dict[str, Any], xrid: str) -> Response:
        if self.decode_mode == "error":
            return JSONResponse({"error": {"message": "decode exploded", "code": 500}},
                                status_code=500)
        prompts = split_prompt(body["prompt"])
        if body.get("stream"):
            # Like vLLM: the stream's headers go out at once, tokens once the KV landed.
            async def events() -> Any:
                finished = False
                try:
                    choices = await self._generate(body, xrid, prompts)
                    if choices is None:
                        yield b'data: {"error": {"message": "no KV", "code": 500}}\n\n'
                    else:
                        tokens = [(c["index"], tok) for c in choices for tok in c["token_ids"]]
                        for k, (index, tok) in enumerate(tokens):
                            if k == 1:
                                await asyncio.to_thread(self.decode_rest.wait,
                                                        self.decode_wait_s)
                            chunk = {"choices": [{"index": index, "token_ids": [tok]}]}
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    finished = True
                finally:
                    if not finished:  # the client went away mid-stream: vLLM aborts
                        self.decode_cancelled.set()
            return StreamingResponse(events(), media_type="text/event-stream")
        choices = await self._generate(body, xrid, prompts)
        if choices is None:
            return JSONResponse({"error": {"message": "no KV", "code": 500}}, status_code=500)
        return JSONResponse({"id": f"cmpl-{xrid}", "object": "text_completion",
                             "choices": choices})

    async def _generate(self, body: dict[str, Any], xrid: str,
                        prompts: list[Any]) -> list[dict[str, Any]] | None:
        """Post the rendezvous, wait for every prompt's KV, "decode"; None without KV."""
        params = body["kv_transfer_params"]
        # vLLM 0.32 names sub-request i cmpl-<X-Request-Id>-<i> and appends -<8 hex>
        # internally; the project's connector posts the name without the suffix.
        ids = [f"cmpl-{xrid}-{i}" for i in range(len(prompts))]
        if self.post_internal_ids:
            ids = [f"{rid}-{uuid.uuid4().hex[:8]}" for rid in ids]
        if self.decode_mode in ("ok", "read_failed"):
            for i, rid in enumerate(ids):
                if i and self.rendezvous_gap_s:
                    await asyncio.sleep(self.rendezvous_gap_s)
                await asyncio.to_thread(self.rendezvous_gate.wait, self.decode_wait_s)
                with self.lock:
                    self.posts_started += 1
                cached = self.cached_tokens[i] if self.cached_tokens else 0
                rdv = Rendezvous(request_id=rid, remote_engine_id="d-engine",
                                 remote_host="127.0.0.1", remote_port=self.decode_port,
                                 remote_tp_size=1, remote_cached_tokens=cached,
                                 keeps_local_prefix=self.keeps_local_prefix,
                                 free_kv_share=self.free_kv_share,
                                 free_seq_slots=self.free_seq_slots,
                                 seq_slots=self.seq_slots)
                status = await asyncio.to_thread(post_rendezvous, params["metaserver"], rdv)
                with self.posted_cond:
                    self.posted.append((rid, status))
                    self.posted_cond.notify_all()
        if self.decode_mode == "read_failed":
            # The connector's report races vLLM's own answer, as on a real Decode.
            self.reporter.report(params["metaserver"], ids[0], "Decode rank 0 could not "
                                 "receive the KV: F2: the host engine serves readers on "
                                 "this host only")
            return None
        for i in range(len(ids)):
            landed = await asyncio.to_thread(self.event(f"cmpl-{xrid}-{i}").wait,
                                             self.decode_wait_s)
            if not landed:
                return None
        await asyncio.to_thread(self.decode_release.wait, self.decode_wait_s)
        max_tokens = int(body.get("max_tokens", 16))
        return [{"index": i, "text": "", "token_ids": fake_tokens(p, max_tokens),
                 "finish_reason": "length"} for i, p in enumerate(prompts)]

    # -------------------------------------------------------------- fake Prefill

    def _prefill_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            with self.lock:
                self.prefill_calls.append({"body": body, "at": time.monotonic(),
                                           "posts_started": self.posts_started,
                                           "x_request_id": request.headers["x-request-id"],
                                           "accept_encoding":
                                               request.headers.get("accept-encoding")})
            self.prefill_arrived.set()
            if self.prefill_mode == "error":
                return JSONResponse({"error": {"message": "prefill exploded", "code": 500}},
                                    status_code=500)
            # "Pushed the KV" of every sub-request, named as vLLM names them.
            xrid = request.headers["x-request-id"]
            for i in range(len(split_prompt(body["prompt"]))):
                if self.prefill_mode == "lost":
                    # Like the connector whose reader never acknowledged MF_META: the
                    # 1-token answer is 200, the report follows from another thread.
                    self.reporter.report(body["kv_transfer_params"].get("metaserver"),
                                         f"cmpl-{xrid}-{i}", "MF_META not acknowledged "
                                         "within 5.0s")
                else:
                    self.event(f"cmpl-{xrid}-{i}").set()
            await asyncio.to_thread(self.prefill_answer.wait, self.decode_wait_s)
            return JSONResponse({"choices": [
                {"index": i, "text": "", "token_ids": fake_tokens(p, 1)}
                for i, p in enumerate(split_prompt(body["prompt"]))],
                "kv_transfer_params": None})

        return app
