"""Early dispatch at a Decode's capacity, through real vLLM engines (C1, C3).

A Decode that cannot admit a request at once (here: both of its two sequence slots taken by
long completions) queues it. Sent to Prefill early, beside Decode, that request's READYs
would wait for destinations Decode has not allocated, holding Prefill's slots, until
``destination_wait`` runs out and fails it (C1). Each rendezvous therefore tells the
proxy the room Decode has left (``free_kv_share``, ``free_seq_slots``), and the proxy
dispatches early only while there is room for the next completion: here the queued one
goes Decode first and succeeds once a slot frees. (Without the check it is dispatched early
and fails with Decode's "C1: destinations of ... not registered"; the proxy's decision
itself is tested against a fake Decode in test_vllm_proxy.py, and the expiry in the cores'
tests.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")

from vllm_platform import require_cpu_platform  # noqa: E402

require_cpu_platform()  # vLLM 0.33's CUDA wheel cannot run these engines here

from sfa_rd2h.runtime.vllm import launch  # noqa: E402

pytestmark = pytest.mark.timeout(600)

STARTUP_S = 300.0
# Keeps a sequence slot busy for seconds after the queued completion is sent.
LONG_TOKENS = 2040
MAX_MODEL_LEN = 2048
QUEUED = list(range(3, 67))  # 64 tokens: two blocks


@dataclass
class Env:
    dep: launch.Deployment
    alone: list[int]  # the queued prompt's output, computed with Decode idle


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("vllm_capacity")
    model = launch.make_tiny_llama(work / "model", seed=0)
    opts = launch.EngineOptions(model=str(model), max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    dep = launch.Deployment(work_dir=work / "logs", opts=opts, request_timeout_s=120.0)
    try:
        dep.start(time.monotonic() + STARTUP_S)
        # Decode first: the proxy learns the endpoint, and that Decode has room.
        alone = launch.complete(dep.proxy.url, QUEUED, 4)[0]
        yield Env(dep, alone)
    finally:
        dep.close()


def _admitted(env: Env, n: int) -> bool:
    """``n`` completions are in flight and Decode has admitted each (its rendezvous came:
    blocks allocated, a sequence slot taken)."""
    jobs = env.dep.proxy.in_flight()
    return len(jobs) >= n and all(j["rendezvous_ms"] is not None for j in jobs)


def test_a_full_decode_gets_the_next_completion_decode_first(env: Env) -> None:
    """C3: two long completions take Decode's two sequence slots; the next one goes Decode
    first (the latest rendezvous told no slot left), waits there for a slot and is right."""
    longs: list[threading.Thread] = []
    errors: list[Exception] = []

    def long(prompt: list[int]) -> None:
        try:
            launch.complete(env.dep.proxy.url, prompt, LONG_TOKENS)
        except Exception as exc:  # noqa: BLE001 - reported by the waits below
            errors.append(exc)

    for i in range(2):
        t = threading.Thread(target=long, args=([5 + i, 9, 11, 13],), daemon=True)
        t.start()
        longs.append(t)
        # One at a time, each admitted before the next is sent. The proxy's thread sets
        # what this reads: poll it (no event tells a test of a rendezvous).
        deadline = time.monotonic() + 60
        while not _admitted(env, i + 1):
            assert not errors and time.monotonic() < deadline, (
                i, errors, env.dep.proxy.in_flight(), env.dep.log_tails())
            time.sleep(0.1)
    assert launch.complete(env.dep.proxy.url, QUEUED, 4, timeout=60.0) == [env.alone]
    for t in longs:
        t.join(60)
        assert not t.is_alive()
    assert not errors, errors
    assert env.dep.proxy.wait_idle(30.0)
    queued = max(env.dep.proxy.records(), key=lambda r: r["t0"])  # the last one sent
    assert queued["early"] is False, env.dep.proxy.records()[-3:]
    assert [r["early"] for r in env.dep.proxy.records()[-3:]].count(True) >= 1  # the longs'
    for server in env.dep.servers.values():
        launch.wait_drained(server, time.monotonic() + 30, interval=0.05)
