"""Early dispatch at a Decode's capacity, through real vLLM engines (C1, C3).

A Decode that cannot admit a request at once (here: both of its two sequence slots taken by
long completions) queues it. Sent to Prefill early, beside Decode, that request's READYs
would wait for destinations Decode has not allocated, holding Prefill's slots, until
``destination_wait`` runs out and fails it (C1). Each rendezvous therefore tells the
proxy the room Decode has left (``free_kv_share``, ``free_seq_slots``), and the proxy
dispatches early only while there is room for the next completion: here the queued one
goes Decode first, waits in Decode's queue until a client hangs up a long completion, and
is right. (Without the check it is dispatched early and fails with Decode's "C1:
destinations of ... not registered"; the proxy's decision itself is tested against a fake
Decode in test_vllm_proxy.py, and the expiry in the cores' tests.)
"""

from __future__ import annotations

import contextlib
import json
import pprint
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from vllm_platform import require_cpu_platform  # noqa: E402

require_cpu_platform()  # vLLM 0.33's CUDA wheel cannot run these engines here

from sfa_rd2h.runtime.vllm import launch  # noqa: E402

# Start-up (up to 300 s) and every wait below at its limit, so a slow failure still reports.
pytestmark = pytest.mark.timeout(900)

STARTUP_S = 300.0
# The slots are freed by the test hanging up, not by the long completions ending: they are
# sized to stream for a minute or more here (2 048 tokens took 5-10 s, and a CI run once
# stalled past that), and the model's position limit is raised to allow them.
MAX_MODEL_LEN = 16384
LONG_TOKENS = MAX_MODEL_LEN - 8
QUEUED = list(range(3, 67))  # 64 tokens: two blocks


@dataclass
class Env:
    dep: launch.Deployment
    alone: list[int]  # the queued prompt's output, computed with Decode idle


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("vllm_capacity")
    model = launch.make_tiny_llama(work / "model", seed=0)
    opts = launch.EngineOptions(
        model=str(model), max_num_seqs=2, max_model_len=MAX_MODEL_LEN,
        extra_args=("--hf-overrides", json.dumps({"max_position_embeddings": MAX_MODEL_LEN})))
    dep = launch.Deployment(work_dir=work / "logs", opts=opts, request_timeout_s=120.0)
    try:
        dep.start(time.monotonic() + STARTUP_S)
        # Decode first: the proxy learns the endpoint, and that Decode has room.
        alone = launch.complete(dep.proxy.url, QUEUED, 4)[0]
        yield Env(dep, alone)
    finally:
        dep.close()


def _state(env: Env) -> str:
    """What a failed assertion reports: the proxy's open and latest completions (their
    timings), the engines' log tails. A string, which pytest prints whole."""
    return "\n".join((f"in flight: {pprint.pformat(env.dep.proxy.in_flight())}",
                      f"ended: {pprint.pformat(env.dep.proxy.records()[-3:])}",
                      env.dep.log_tails()))


def _wait_for(env: Env, what: str, ready: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll ``ready()`` (the proxy's thread or another process sets what it reads; nothing
    there can be awaited from here)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s\n{_state(env)}"
        time.sleep(0.05)


@contextlib.contextmanager
def _long(env: Env, prompt: list[int]) -> Iterator[None]:
    """A streamed completion of ``LONG_TOKENS``, open once its first token came (Decode
    admitted it: a sequence slot is taken); leaving the block hangs up on it."""
    body = {"model": launch.SERVED_NAME, "prompt": prompt, "max_tokens": LONG_TOKENS,
            "stream": True, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", f"{env.dep.proxy.url}/v1/completions", json=body,
                      timeout=120.0, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a discarded line iterator closes the connection
        first = next((line for line in lines if line.startswith("data: ")), "")
        assert first and json.loads(first[6:]).get("choices"), f"no first token: {first!r}"
        yield


def _decode_queue(env: Env) -> tuple[float, float]:
    """Decode's requests running and waiting, as its ``/metrics`` says."""
    sample = launch.metrics(env.dep.decode.url)
    return (sample.get("vllm:num_requests_running", 0.0),
            sample.get("vllm:num_requests_waiting", 0.0))


def test_a_full_decode_gets_the_next_completion_decode_first(env: Env) -> None:
    """C3: two long completions take Decode's two sequence slots; the next one goes Decode
    first (the latest rendezvous told no slot left), waits in Decode's queue until a client
    hangs up, and is right."""
    got: list[Any] = []

    def queued() -> None:
        try:
            got.append(launch.complete(env.dep.proxy.url, QUEUED, 4, timeout=120.0))
        except Exception as exc:  # noqa: BLE001 - asserted below
            got.append(exc)

    with contextlib.ExitStack() as second_long, contextlib.ExitStack() as first_long:
        for i, stack in enumerate((first_long, second_long)):
            # One at a time, each admitted before the next is sent.
            stack.enter_context(_long(env, [5 + i, 9, 11, 13]))
            _wait_for(env, f"rendezvous of long completion {i + 1}",
                      lambda n=i + 1: len(jobs := env.dep.proxy.in_flight()) >= n
                      and all(j["rendezvous_ms"] is not None for j in jobs))
        sender = threading.Thread(target=queued, daemon=True)
        sender.start()
        _wait_for(env, "queued completion waiting on Decode",
                  lambda: _decode_queue(env) == (2.0, 1.0))
        unadmitted = [j for j in env.dep.proxy.in_flight() if j["rendezvous_ms"] is None]
        assert len(unadmitted) == 1, _state(env)
        waiting = unadmitted[0]
        assert waiting["early"] is False, waiting  # Decode first: no slot was left
        hung_up = time.monotonic()
        first_long.close()  # a slot frees only now
        sender.join(120.0)
        assert got == [[env.alone]], f"{got}\n{_state(env)}"
    assert env.dep.proxy.wait_idle(30.0), _state(env)
    *longs_done, queued_done = sorted(env.dep.proxy.records()[-3:], key=lambda r: r["t0"])
    assert queued_done["id"] == waiting["id"] and queued_done["early"] is False
    # Decode admitted it only once the hung-up completion gave its slot back (the proxy's
    # loop reads the same monotonic clock, to the millisecond; a long one that had ended
    # by itself would have let it in before the hang-up).
    assert queued_done["t0"] + queued_done["rendezvous_ms"] / 1e3 > hung_up, queued_done
    assert [r["outcome"] for r in longs_done] == ["client gone"] * 2, longs_done
    assert any(r["early"] for r in longs_done)  # while there was room, early
    for server in env.dep.servers.values():
        launch.wait_drained(server, time.monotonic() + 30, interval=0.05)
