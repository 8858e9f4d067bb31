"""The workload and the client of ``sfa-rd2h vllm-bench``.

The requests are sent the way ``vllm.benchmarks`` sends them (its SSE framing, TTFT = the
first streamed chunk with a choice, its Poisson arrivals) plus what it lacks here: token ids
in the answer (the engines run without a tokenizer), prompt lists, non-streamed requests,
and clients that hang up mid-stream or before their first token. ITL is per request:
(end-to-end - TTFT) / (tokens - 1), as several SSE events arrive in one socket read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

KINDS = ("short", "aligned", "chunked", "list", "prefix")
#: The client keeps an idle connection this long (below the servers' 5 s keep-alive).
CLIENT_KEEPALIVE_S = 2.0


# ---------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Req:
    """One client request of the workload."""

    idx: int
    kind: str  # one of KINDS
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    stream: bool
    cancel: str | None = None  # None, "mid" (after cancel_after tokens), "early"
    cancel_after: int = 0  # tokens seen before a "mid" hang-up
    cancel_delay_s: float = 0.0  # seconds after sending an "early" hang-up comes

    @property
    def prompt(self) -> list[int] | list[list[int]]:
        if self.kind == "list":
            return [list(p) for p in self.prompts]
        return list(self.prompts[0])

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class Shape:
    """The engines' settings the workload is cut to."""

    block_size: int
    chunk_tokens: int  # --max-num-batched-tokens
    max_model_len: int
    vocab: int
    max_output: int = 64


def make_workload(n: int, shape: Shape, seed: int, cancel_frac: float = 0.10,
                  first_idx: int = 0) -> list[Req]:
    """``n`` seeded requests: prompts under one block, exactly block-aligned, longer than the
    chunk size (chunked prefill), prompt lists, and prompts sharing one of three prefixes
    (prefix-cache hits); 1-``max_output`` greedy tokens; 80% streamed; ``cancel_frac`` of
    them cancelled, half mid-stream and half before their first token."""
    rng = random.Random(seed)
    b, chunk = shape.block_size, shape.chunk_tokens
    room = shape.max_model_len - shape.max_output

    def tokens(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, shape.vocab) for _ in range(k))

    prefixes = [tokens(b * rng.randint(2, 4)) for _ in range(3)]
    n_cancel = round(n * cancel_frac)
    cancels = ["mid"] * (n_cancel - n_cancel // 2) + ["early"] * (n_cancel // 2)
    cancels += [None] * (n - len(cancels))
    rng.shuffle(cancels)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS)
        if kind == "short":
            prompts = (tokens(rng.randint(1, b - 1)),)
        elif kind == "aligned":
            prompts = (tokens(b * rng.randint(1, max(1, min(4, room // b)))),)
        elif kind == "chunked":
            prompts = (tokens(rng.randint(chunk + 1, max(chunk + 1, room))),)
        elif kind == "list":
            prompts = tuple(tokens(rng.randint(1, 3 * b)) for _ in range(rng.randint(2, 3)))
        else:
            prompts = (rng.choice(prefixes) + tokens(rng.randint(1, b + 8)),)
        cancel = cancels[i]
        max_tokens = rng.randint(1, shape.max_output)
        if cancel == "mid":
            max_tokens = max(max_tokens, 8)  # room to hang up after some tokens
        stream = cancel is not None or rng.random() < 0.8  # a hang-up needs a stream
        out.append(Req(first_idx + i, kind, prompts, max_tokens, stream, cancel,
                       cancel_after=rng.randint(1, max_tokens // 2) if cancel == "mid" else 0,
                       cancel_delay_s=rng.uniform(0.0, 0.01) if cancel == "early" else 0.0))
    return out


def workload_summary(reqs: Sequence[Req]) -> dict[str, Any]:
    kinds = {k: sum(r.kind == k for r in reqs) for k in KINDS}
    return {"requests": len(reqs), "kinds": kinds,
            "streamed": sum(r.stream for r in reqs),
            "cancelled_mid": sum(r.cancel == "mid" for r in reqs),
            "cancelled_early": sum(r.cancel == "early" for r in reqs),
            "prompt_tokens": [min(r.prompt_tokens for r in reqs),
                              max(r.prompt_tokens for r in reqs)],
            "max_tokens": [min(r.max_tokens for r in reqs), max(r.max_tokens for r in reqs)]}


# ---------------------------------------------------------------------------- the client


@dataclass
class Outcome:
    """What one request got: vLLM's ``RequestFuncOutput`` fields plus the token ids."""

    idx: int
    success: bool = False
    error: str = ""
    tokens: list[list[int]] = field(default_factory=list)  # per prompt
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    cancelled: bool = False
    params: dict[str, Any] | None = None  # kv_transfer_params a Prefill returned
    resp_id: str | None = None  # the completion's id (the sfa proxy's job id)


def _body(req: Req, max_tokens: int, stream: bool,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from sfa_rd2h.runtime.vllm.launch import SERVED_NAME

    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": req.prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {**body, **(extra or {})}


async def send(session: Any, url: str, req: Req, *, max_tokens: int | None = None,
               stream: bool | None = None, cancel: bool = True,
               extra: dict[str, Any] | None = None) -> Outcome:
    """One ``/v1/completions`` request, measured as ``vllm.benchmarks`` measures it; a
    request marked for cancellation closes its connection at its point."""
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    stream = req.stream if stream is None else stream
    out = Outcome(req.idx, tokens=[[] for _ in req.prompts])
    st = time.perf_counter()
    last = st
    hang_up = req.cancel if cancel else None

    async def run() -> None:
        nonlocal last
        async with session.post(f"{url}/v1/completions",
                                json=_body(req, max_tokens, stream, extra)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            if not stream:
                data = await resp.json()
                out.resp_id = data.get("id")
                for c in data["choices"]:
                    out.tokens[c["index"]] = list(c.get("token_ids") or [])
                out.params = data.get("kv_transfer_params")
                out.latency = time.perf_counter() - st
                out.success = True
                return
            handler = StreamedResponseHandler()
            seen = 0
            async for raw in resp.content.iter_any():
                for msg in handler.add_chunk(raw):
                    if msg.startswith(":"):
                        continue
                    chunk = msg.removeprefix("data: ")
                    if chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    if "error" in data:
                        out.error = f"stream error: {data['error'].get('message')}"
                        return
                    out.resp_id = out.resp_id or data.get("id")
                    choices = data.get("choices") or []
                    if not choices:
                        continue
                    now = time.perf_counter()
                    if out.ttft is None:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    for c in choices:
                        got = list(c.get("token_ids") or [])
                        out.tokens[c["index"]] += got
                        seen += len(got)
                    if hang_up == "mid" and seen >= req.cancel_after:
                        out.cancelled = True
                        resp.close()  # the connection, mid-stream: vLLM aborts the request
                        return
            out.latency = last - st
            out.success = True

    try:
        if hang_up == "early":
            # Hang up while Prefill or the transfer runs: the request is dropped unanswered.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run(), timeout=req.cancel_delay_s)
            out.cancelled = True
        else:
            await run()
    except Exception as exc:  # noqa: BLE001 - any failure is this request's error
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def send_pd(session: Any, prefill_url: str, decode_url: str, req: Req,
                  prefill_params: dict[str, Any] | None) -> Outcome:
    """vLLM's documented P/D proxy flow, from the client: Prefill computes the prompt and
    one token (``kv_transfer_params`` = ``prefill_params``), then Decode answers with the
    parameters Prefill returned; TTFT and latency count from before the Prefill call. Prompt
    lists are sent as one Prefill and one Decode request per prompt (a completion carries one
    ``kv_transfer_params``), merged into one outcome."""
    st = time.perf_counter()
    subs = [Req(req.idx, "single", (p,), req.max_tokens, req.stream, req.cancel,
                req.cancel_after, req.cancel_delay_s) for p in req.prompts]

    async def one(sub: Req) -> Outcome:
        extra = {"kv_transfer_params": prefill_params} if prefill_params else None
        pre = await send(session, prefill_url, sub, max_tokens=1, stream=False, cancel=False,
                         extra=extra)
        if not pre.success:
            pre.error = f"prefill: {pre.error}"
            return pre
        extra = {"kv_transfer_params": pre.params} if pre.params else None
        return await send(session, decode_url, sub, extra=extra)

    if req.cancel == "early":
        outs: list[Outcome] = []
        with contextlib.suppress(asyncio.TimeoutError):
            outs = await asyncio.wait_for(asyncio.gather(*(one(s) for s in subs)),
                                          timeout=req.cancel_delay_s)
        return Outcome(req.idx, tokens=[o.tokens[0] for o in outs] or [[] for _ in subs],
                       cancelled=True)
    outs = list(await asyncio.gather(*(one(s) for s in subs)))
    elapsed = time.perf_counter() - st
    merged = Outcome(req.idx, success=all(o.success for o in outs),
                     error="; ".join(o.error for o in outs if o.error),
                     tokens=[o.tokens[0] for o in outs],
                     cancelled=any(o.cancelled for o in outs), latency=elapsed)
    ttfts = [o.ttft for o in outs if o.ttft is not None]
    if ttfts:
        # The Decode call's own clock started after its Prefill: shift to the client's.
        merged.ttft = elapsed - max(o.latency for o in outs) + min(ttfts)
        merged.itl = [x for o in outs for x in o.itl]
    return merged


async def run_load(requests: Sequence[Req], submit: Callable[[Any, Req], Any], *,
                   concurrency: int | None, rate: float | None, seed: int) -> list[Outcome]:
    """Every request through ``submit``: at a fixed concurrency, or arriving as a Poisson
    process of ``rate`` requests/s (``vllm.benchmarks.serve.get_request``)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=300)
    # Idle connections are dropped before the servers drop theirs (uvicorn's keep-alive,
    # 5 s in vLLM and the proxy): a request on a connection being closed gets a reset.
    connector = aiohttp.TCPConnector(limit=0, force_close=False,
                                     keepalive_timeout=CLIENT_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     trust_env=False) as session:
        if rate is None:
            sem = asyncio.Semaphore(concurrency or 1)

            async def limited(r: Req) -> Outcome:
                async with sem:
                    return await submit(session, r)

            return list(await asyncio.gather(*(limited(r) for r in requests)))
        from vllm.benchmarks.serve import get_request

        np_state = _seed_numpy(seed)
        tasks = []
        try:
            async for r, _rate in get_request(list(requests), rate):
                tasks.append(asyncio.ensure_future(submit(session, r)))
        finally:
            _restore_numpy(np_state)
        return list(await asyncio.gather(*tasks))


def _seed_numpy(seed: int) -> Any:
    # get_request draws its intervals from numpy's global generator.
    import numpy as np

    state = np.random.get_state()
    np.random.seed(seed)
    return state


def _restore_numpy(state: Any) -> None:
    import numpy as np

    np.random.set_state(state)


def per_token_itl(o: Outcome) -> float | None:
    """A streamed request's inter-token latency, (end-to-end - TTFT) / (tokens - 1): the
    gaps between SSE events say nothing here, as several events arrive in one socket read.
    A prompt list's choices are generated side by side, so its tokens are one choice's."""
    n = max((len(t) for t in o.tokens), default=0)
    if o.ttft is None or n < 2:
        return None
    return max(0.0, o.latency - o.ttft) / (n - 1)
