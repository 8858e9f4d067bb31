"""A real disaggregated run through vLLM on CPU (C1-C4, F2, R5, S1).

A Prefill engine and a Decode engine, each a ``vllm serve`` process tree running
``SfaRemoteD2HConnector`` over the host transfer engine, the D-first proxy in front, and a
client sending greedy completions of token-id prompts through the proxy. Both engines and
the single-engine reference (an offline ``LLM`` without a connector, started alongside them)
load the same random tiny Llama, saved here. The disaggregated outputs must equal the
reference token for token: a prompt shorter than a block, a block-aligned one, one longer
than ``--max-num-batched-tokens`` (prefill in several chunks) and a prompt list; then a
streamed completion, and a repeated prompt that Decode partly holds already, dispatched
to Prefill early (C3, C5). Last, one request goes to a second Decode engine whose reads fail
for real (its host engine is forced into shm mode, which cannot read the KV cache vLLM
allocated on Prefill, F2) while others go to the good one: that request gets an HTTP error
through its proxy, the others still match, and every engine ends with every KV block freed.

Everything is bounded: engines must be healthy before a deadline (polled, never slept for),
every request has a timeout, and the module finalizer stops every process.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_platform import require_cpu_platform  # noqa: E402

require_cpu_platform()  # vLLM 0.33's CUDA wheel cannot run these engines here

from sfa_rd2h.runtime.vllm import launch  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

MAX_TOKENS = 8
CHUNK = 128  # --max-num-batched-tokens: the chunked case is longer than this
STARTUP_S = 240.0  # three engines and the reference: 100-150 s on a busy 2-core box
REQUEST_S = 90.0
# A Decode whose every read fails as a transfer error (F2): a shm-mode host engine can read
# only memory its peer allocated through the engine, never vLLM's own KV cache on Prefill.
FAILING = "decode_failing"
FAILING_EXTRA = {"engine_options": {"mode": "shm"}}


@dataclass
class Env:
    dep: launch.Deployment
    opts: launch.EngineOptions
    cases: list[launch.Case]
    victim: tuple[int, ...]
    streamed: tuple[int, ...]
    bystanders: list[launch.Case]
    reference: dict[tuple[int, ...], list[int]]
    started: float
    figures: dict
    # What the main Decode and the Prefill must have counted so far, over every test run in
    # this module: the stats arrive in the logs a second late, so each test compares with
    # the running totals rather than with a snapshot that may still miss earlier requests.
    received: int = 0  # main Decode: requests whose KV arrived whole
    blocks: int = 0  # main Decode: blocks received
    sent: int = 0  # Prefill: requests released after every READY was answered

    def settle(self) -> tuple[dict[str, float], dict[str, float]]:
        """Main Decode's and Prefill's stats once they reached the running totals."""
        deadline = time.monotonic() + 30
        d = self.dep.wait_stats("decode", "requests_received", self.received, deadline)
        if d.get("blocks_received", 0) < self.blocks:
            d = self.dep.wait_stats("decode", "blocks_received", self.blocks, deadline)
        p = self.dep.wait_stats("prefill", "requests_sent", self.sent, deadline)
        return d, p


def _prompts(cases: Sequence[launch.Case]) -> list[tuple[int, ...]]:
    return [p for c in cases for p in c.prompts]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Env:
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("vllm_e2e")
    model = launch.make_tiny_llama(work / "model", seed=0)
    opts = launch.EngineOptions(model=str(model), max_num_batched_tokens=CHUNK)
    cases = launch.demo_cases(opts, seed=0)
    others = launch.demo_cases(opts, seed=1)
    bystanders = [others[0], others[3]]  # a single prompt and a prompt list
    victim = others[1].prompts[0]
    streamed = launch.demo_cases(opts, seed=2)[1].prompts[0]
    everyone = _prompts(cases) + _prompts(bystanders) + [streamed]
    dep = launch.Deployment(work_dir=work / "logs", opts=opts,
                            decode_variants={FAILING: dict(FAILING_EXTRA)},
                            request_timeout_s=REQUEST_S)
    request.addfinalizer(dep.close)  # every engine process is stopped, whatever happens
    dep.start(time.monotonic() + STARTUP_S, reference_prompts=everyone,
              max_tokens=MAX_TOKENS)
    assert dep.reference is not None
    outputs = dep.reference.result(timeout=STARTUP_S)
    reference = dict(zip(everyone, outputs, strict=True))
    figures = {"startup_s": round(dep.startup_s or 0.0, 1),
               "reference_s": round(dep.reference.seconds or 0.0, 1)}
    e = Env(dep, opts, cases, victim, streamed, bystanders, reference, t0, figures)

    def report() -> None:
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        (work / "figures.json").write_text(json.dumps(figures, indent=1))
        print(f"\nvLLM e2e figures ({work}/figures.json): {json.dumps(figures)}")

    request.addfinalizer(report)
    return e


def _send(env: Env, cases: Sequence[launch.Case],
          decode: Sequence[str] = ()) -> list[list[list[int]] | Exception]:
    """Every case at once (so Prefill batches and chunks them), case ``i`` through the proxy
    in front of Decode ``decode[i]`` (default: the main one)."""
    names = list(decode) or ["decode"] * len(cases)

    def one(i: int) -> list[list[int]] | Exception:
        try:
            return launch.complete(env.dep.proxies[names[i]].url, cases[i].prompt,
                                   MAX_TOKENS, timeout=REQUEST_S)
        except launch.CompletionError as exc:
            return exc

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, range(len(cases))))


def _mismatches(env: Env, cases: Sequence[launch.Case],
                results: Sequence[list[list[int]] | Exception]) -> list[str]:
    bad = []
    for case, result in zip(cases, results, strict=True):
        if isinstance(result, Exception):
            bad.append(f"{case.name}: {result}")
            continue
        for i, (prompt, got) in enumerate(zip(case.prompts, result, strict=True)):
            if got != env.reference[prompt]:
                bad.append(f"{case.name}[{i}] ({len(prompt)} tokens): disaggregated {got} "
                           f"!= single engine {env.reference[prompt]}")
    return bad


def test_disaggregated_outputs_equal_single_engine_token_for_token(env: Env) -> None:
    chunked = next(c for c in env.cases if c.name == "chunked")
    assert len(chunked.prompts[0]) > CHUNK  # prefill really runs in several steps
    assert any(c.as_list and len(c.prompts) > 1 for c in env.cases)

    t0 = time.monotonic()
    results = _send(env, env.cases)
    env.figures["requests_s"] = round(time.monotonic() - t0, 2)
    prompts = _prompts(env.cases)
    blocks = launch.expected_blocks(prompts, env.opts.block_size)
    env.received += len(prompts)
    env.blocks += blocks
    env.sent += len(prompts)
    bad = _mismatches(env, env.cases, results)
    assert not bad, "\n".join(bad) + "\n" + env.dep.log_tails()
    assert all(len(out) == MAX_TOKENS for r in results for out in r)  # type: ignore[union-attr]

    # The connector's own figures: every destination block arrived, nothing failed.
    d, p = env.settle()
    assert d.get("requests_received") == env.received, d
    assert d.get("blocks_received") == env.blocks, d
    assert d.get("bytes_read") == env.blocks * launch.kv_bytes_per_block(env.opts), d
    assert d.get("requests_failed", 0) == 0 and d.get("failed_reads", 0) == 0, d
    assert d.get("rendezvous_posted") == env.received, d
    assert p.get("requests_sent") == env.sent, p
    assert p.get("blocks_sent") == env.blocks, p
    assert p.get("send_failures", 0) == 0, p

    jobs = env.dep.proxy.records(len(env.cases), timeout=10.0)
    assert [j["outcome"] for j in jobs] == ["ok"] * len(env.cases)
    # Blocks are freed on both sides (Prefill's once every READY was answered, S1).
    launch.wait_drained(env.dep.prefill, time.monotonic() + 30)
    launch.wait_drained(env.dep.decode, time.monotonic() + 30)

    env.figures.update(
        requests=len(prompts), blocks=blocks, bytes_read=int(d["bytes_read"]),
        bytes_per_request=int(d["bytes_read"] / len(prompts)),
        blocks_per_request=round(blocks / len(prompts), 2),
        batched_reads=d.get("reads"),
        decode_avg_layer_read_ms=d.get("avg_layer_read_ms"),
        prefill_avg_ready_rtt_ms=p.get("avg_layer_read_ms"),
        proxy_rendezvous_ms=[j["rendezvous_ms"] for j in jobs],
        proxy_done_ms=[j["done_ms"] for j in jobs])


def test_streamed_and_repeated_prompts(env: Env) -> None:
    """The proxy passes vLLM's event stream through; a prompt Decode has seen before is a
    local prefix hit there. The proxy knows this Decode by now and dispatches to Prefill
    early, before the rendezvous, with no cached tokens (C3): Prefill names every block,
    Decode pulls only those after its own prefix (C5), and the output still equals the
    reference."""
    import httpx

    tokens: list[int] = []
    body = {"model": launch.SERVED_NAME, "prompt": list(env.streamed), "stream": True,
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    env.received += 1
    env.blocks += launch.expected_blocks([env.streamed], env.opts.block_size)
    env.sent += 1
    with httpx.stream("POST", f"{env.dep.proxy.url}/v1/completions", json=body,
                      timeout=REQUEST_S, trust_env=False) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    # Server-sent events ending in [DONE]; how many tokens each event carries depends on
    # how fast the server's output loop runs.
    assert len(events) >= 2 and events[-1] == "[DONE]"
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            tokens += choice.get("token_ids") or []
    assert tokens == env.reference[env.streamed]

    chunked = next(c for c in env.cases if c.name == "chunked")
    env.received += 1
    env.sent += 1
    (again,) = launch.complete(env.dep.proxy.url, chunked.prompt, MAX_TOKENS,
                               timeout=REQUEST_S)
    assert again == env.reference[chunked.prompts[0]]
    d, _ = env.settle()
    pulled = int(d.get("blocks_received", 0)) - env.blocks
    env.blocks += pulled
    total = launch.expected_blocks(chunked.prompts, env.opts.block_size)
    assert 0 < pulled < total, d  # the prefix hit was not pulled again
    assert env.dep.proxy.wait_idle(10.0)
    assert env.dep.proxy.records()[-1]["early"] is True
    env.figures["repeated_prompt_blocks_pulled"] = f"{pulled} of {total}"


def test_read_failure_fails_only_its_request(env: Env) -> None:
    victim = launch.Case("victim", (env.victim,))
    cases = [victim, *env.bystanders]
    n_ok = len(_prompts(env.bystanders))
    env.received += n_ok
    env.blocks += launch.expected_blocks(_prompts(env.bystanders), env.opts.block_size)
    env.sent += 1 + n_ok
    # Diagnostics for a known intermittent stall (README): a request still unanswered
    # after 30 s makes every engine's vLLM workers print their thread stacks to the log,
    # and the kernel's view of every thread is taken twice, 5 s apart.
    states: list[str] = []
    stop = threading.Event()

    def diagnose() -> None:
        if stop.wait(30.0):
            return
        for server in env.dep.servers.values():
            server.dump_threads()
        for _ in range(2):
            # per-CPU user/nice/system/idle/iowait/irq/softirq/steal ticks: a core that
            # is busy, idle or stolen while the threads pinned to it do not run
            cpus = [ln for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("cpu")]
            states.append(f"at {time.monotonic() - t0:.0f} s:\n" + "\n".join(
                [*cpus, *(s.thread_states() for s in env.dep.servers.values())]))
            if stop.wait(5.0):
                return

    t0 = time.monotonic()
    watcher = threading.Thread(target=diagnose, daemon=True)
    watcher.start()
    try:
        results = _send(env, cases, decode=[FAILING] + ["decode"] * len(env.bystanders))
    finally:
        stop.set()
        watcher.join()

    # The victim's error reaches the client through its proxy: Decode's vLLM fails the
    # request (kv_load_failure_policy "fail"), its connector reports why, and the proxy
    # answers Decode's status with that cause (F2).
    error = results[0]
    assert isinstance(error, launch.CompletionError), (error, env.dep.log_tails())
    assert error.status == 502, (  # the reported cause's status, whichever came first
        f"{error}\nfailing proxy's jobs: "
        f"{launch.get_json(env.dep.proxies[FAILING].url + '/v1/proxy/jobs')}\n"
        f"{env.dep.log_tails()}\nthreads, as the kernel saw them:\n" + "\n".join(states))
    bad = _mismatches(env, cases[1:], results[1:])
    assert not bad, "\n".join(bad) + "\n" + env.dep.log_tails()

    # Only this test uses the failing Decode, so its totals are this request's.
    f = env.dep.wait_stats(FAILING, "requests_failed", 1, time.monotonic() + 30)
    assert f.get("requests_failed") == 1, f
    assert f.get("failed_reads", 0) >= 1, f  # F2: a read failed, not a timeout
    assert f.get("requests_received", 0) == 0, f
    # Prefill released every request, the victim included: each READY got its answer
    # (READ_FAILED is one), so each reached finished_sending.
    d, p = env.settle()
    assert d.get("requests_received") == env.received, d
    assert d.get("requests_failed", 0) == 0, d
    assert p.get("requests_sent") == env.sent, p

    # Cleanly: nothing hangs and no block stays held on any side; Prefill's blocks of the
    # victim are released once its READYs were answered READ_FAILED (S1, S4).
    launch.wait_drained(env.dep.prefill, time.monotonic() + 60)
    launch.wait_drained(env.dep.servers[FAILING], time.monotonic() + 30)
    launch.wait_drained(env.dep.decode, time.monotonic() + 30)
    (job,) = env.dep.proxies[FAILING].records(1, timeout=10.0)
    assert job["outcome"].startswith("the KV of ") and "F2: batched read returned" in \
        job["outcome"], job
    assert "Decode rank 0 could not receive the KV: F2" in error.body, error.body
    logged = "KV load failure" in env.dep.servers[FAILING].log_text()
    if job["decode_headers_ms"] is not None:
        # Decode answered first, so vLLM's own failure policy ended the request
        assert logged
    else:
        # The connector's report overtook Decode's answer and the proxy closed Decode's
        # call: vLLM may then abort the request before a step takes up the failed
        # load, and logs nothing of it. Either way it ended: the Decode drained above.
        print("the failure report overtook Decode's answer; vLLM "
              + ("failed the load itself" if logged else "aborted on the proxy's close"))
    env.figures["failure_case"] = {"failing_decode": f, "prefill": p}


def test_each_engine_binds_its_ipc_sockets_in_a_folder_of_its_own(env: Env) -> None:
    """vLLM's ZMQ IPC sockets (API server to EngineCore) are bound in the folder launch gave
    each engine (``VLLM_RPC_BASE_PATH``), which stopping it removes (test_engine_stop.py),
    not in /tmp, where those of every engine that did not close them stayed."""
    for name, server in env.dep.servers.items():
        assert server.rpc_dir is not None and server.rpc_dir.parent == Path(tempfile.gettempdir())
        sockets = [p for p in server.rpc_dir.iterdir() if p.is_socket()]
        assert sockets, (name, sorted(server.rpc_dir.iterdir()))
