"""The D-first proxy (runtime/vllm/proxy.py) against fake Prefill/Decode servers: the flow,
C3 for prompt lists, the metaserver's answers (F1 contract), and every failure reaching the
client as an HTTP error within its deadline."""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import httpx  # noqa: E402 - installed with vLLM
from vllm_support import Backends, fake_tokens  # noqa: E402

from sfa_rd2h.runtime.metaserver import Rendezvous, post_rendezvous  # noqa: E402
from sfa_rd2h.runtime.vllm.proxy import (  # noqa: E402
    DisaggProxy,
    ProxyError,
    prefill_params,
    split_prompt,
)
from sfa_rd2h.runtime.vllm.proxy import (  # noqa: E402
    main as proxy_main,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def backends() -> Iterator[Backends]:
    b = Backends().start()
    yield b
    b.close()


def make_proxy(b: Backends, **kw: float) -> DisaggProxy:
    assert b.prefill is not None and b.decode is not None
    proxy = DisaggProxy([b.prefill.url], [b.decode.url], **kw)  # type: ignore[arg-type]
    proxy.start()
    return proxy


@pytest.fixture
def proxy(backends: Backends) -> Iterator[DisaggProxy]:
    p = make_proxy(backends)
    yield p
    p.close()


def complete(proxy: DisaggProxy, body: dict, timeout: float = 20.0) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=timeout,
                      trust_env=False)


def test_split_prompt_shapes():
    assert split_prompt("hi") == ["hi"]
    assert split_prompt([1, 2, 3]) == [[1, 2, 3]]
    assert split_prompt(["a", "b"]) == ["a", "b"]
    assert split_prompt([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ("", [], [[]], [1, "a"], [True], None, 7, [[1], "a"]):
        with pytest.raises(ProxyError):
            split_prompt(bad)


def test_single_prompt_flows_decode_first(backends, proxy):
    prompt = list(range(10, 30))
    r = complete(proxy, {"model": "m", "prompt": prompt, "max_tokens": 5,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == fake_tokens(prompt, 5)
    (d_call,) = backends.decode_calls
    xrid = d_call["x_request_id"]
    assert d_call["body"]["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "metaserver": proxy.metaserver_url}
    assert d_call["body"]["max_tokens"] == 5
    (p_call,) = backends.prefill_calls
    body = p_call["body"]
    assert body["max_tokens"] == 1 and body["min_tokens"] == 1 and body["stream"] is False
    assert body["prompt"] == prompt
    # Same X-Request-Id, so vLLM names the request cmpl-<xrid>-0 on both sides.
    assert p_call["x_request_id"] == xrid
    # Decode's body is relayed byte for byte: both answers are asked for uncompressed.
    assert d_call["accept_encoding"] == p_call["accept_encoding"] == "identity"
    assert backends.posted == [(f"cmpl-{xrid}-0", 200)]
    params = body["kv_transfer_params"]  # what Decode posted, and where to report a failure
    assert params == {**Rendezvous(request_id=f"cmpl-{xrid}-0", remote_engine_id="d-engine",
                                   remote_host="127.0.0.1", remote_port=20000,
                                   remote_tp_size=1, free_kv_share=1.0,
                                   free_seq_slots=16, seq_slots=16).to_json(),
                      "metaserver": proxy.metaserver_url}
    assert len(proxy.records(1, timeout=10.0)) == 1  # written once Prefill's answer is in
    jobs = httpx.get(f"{proxy.url}/v1/proxy/jobs", trust_env=False).json()
    assert jobs[-1]["outcome"] == "ok" and jobs[-1]["rendezvous_ms"] is not None
    assert jobs[-1]["prefill_status"] == 200  # what Prefill answered, for a stuck request


def test_the_serving_threads_cpu_time_is_counted(backends):
    proxy = DisaggProxy([backends.prefill.url], [backends.decode.url])
    assert proxy.cpu_seconds() == 0.0  # not serving yet
    proxy.start()
    try:
        before = proxy.cpu_seconds()
        for _ in range(5):
            r = complete(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3})
            assert r.status_code == 200, r.text
        assert proxy.cpu_seconds() > before
    finally:
        proxy.close()
    assert proxy.cpu_seconds() == 0.0  # its thread is gone


def test_a_record_written_after_the_client_has_its_answer_can_be_awaited(backends, proxy):
    # Decode answers once the KV landed; Prefill's own answer trails it, and the job's
    # record is written only when both are in.
    backends.prefill_answer.clear()
    r = complete(proxy, {"model": "m", "prompt": [7, 8, 9], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert proxy.records() == [] and proxy.records(1, timeout=0.05) == []
    assert httpx.get(f"{proxy.url}/v1/proxy/jobs", trust_env=False).json() == []
    assert proxy.jobs_in_flight == 1 and not proxy.wait_idle(0.05)
    backends.prefill_answer.set()
    assert proxy.wait_idle(10.0) and proxy.jobs_in_flight == 0
    (job,) = proxy.records(1, timeout=0.0)  # idle: every record written
    assert job["outcome"] == "ok" and job["prefill_status"] == 200
    assert job["done_ms"] <= job["prefill_done_ms"], job  # the client had it first
    assert httpx.get(f"{proxy.url}/v1/proxy/jobs", trust_env=False).json() == [job]


def test_every_connection_the_proxy_accepts_sends_at_once():
    """TCP_NODELAY on every accepted connection, whichever loop serves them: asyncio's own
    loop sets it only on a socket whose proto says TCP, and without it each relayed token
    waited for the client's delayed ACK (about 40 ms a completion under ``python -m``)."""
    proxy = DisaggProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    listener = proxy._bind()
    try:
        listener.setblocking(True)
        with socket.create_connection(listener.getsockname()[:2], timeout=5):
            conn, _ = listener.accept()
            with conn:
                assert conn.proto == socket.IPPROTO_TCP
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        listener.close()


def test_the_proxy_command_answers_as_its_thread_does(backends, tmp_path):
    """``python -m sfa_rd2h.runtime.vllm.proxy`` as vllm-bench runs it (``ProxyProcess``):
    completions, the records written once Prefill's trailing answer is in, waiting for
    idle over ``/v1/proxy/in-flight``, the process's CPU, and a close that ends it."""
    from sfa_rd2h.runtime.vllm.launch import ProxyProcess

    proc = ProxyProcess([backends.prefill.url], [backends.decode.url],
                        tmp_path / "proxy.log", request_timeout_s=20.0)
    assert proc.cpu_seconds() == 0.0  # not started
    proc.start(timeout=30.0)
    try:
        backends.prefill_answer.clear()
        r = complete(proc, {"model": "m", "prompt": [4, 5, 6], "max_tokens": 3,
                            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == fake_tokens([4, 5, 6], 3)
        assert proc.records() == [] and proc.jobs_in_flight == 1
        (held,) = proc.in_flight()
        assert held["dispatched"] and held["prefill_pending"] == 1, held
        assert not proc.wait_idle(0.05)
        backends.prefill_answer.set()
        assert proc.wait_idle(10.0) and proc.jobs_in_flight == 0
        (job,) = proc.records()
        assert job["outcome"] == "ok" and job["prefill_status"] == 200
        assert proc.cpu_seconds() > 0.0
    finally:
        proc.close()
    assert proc.proc is not None and proc.proc.poll() is not None
    assert proc.cpu_seconds() == 0.0  # gone


def test_prompt_list_reaches_prefill_once_after_every_rendezvous(backends, proxy):
    # C3: the posts are staggered; Prefill must see nothing before the last one.
    backends.rendezvous_gap_s = 0.2
    backends.cached_tokens = (64, 32, 96)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    r = complete(proxy, {"model": "m", "prompt": prompts, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert [c["token_ids"] for c in r.json()["choices"]] == \
        [fake_tokens(p, 3) for p in prompts]
    assert len(backends.posted) == 3
    (p_call,) = backends.prefill_calls  # once, the whole list, in order
    assert p_call["posts_started"] == 3
    assert p_call["body"]["prompt"] == prompts
    params = p_call["body"]["kv_transfer_params"]
    xrid = p_call["x_request_id"]
    assert params["remote_cached_tokens"] == 32  # the smallest: never skip a needed block
    assert sorted(params["rendezvous"]) == [f"cmpl-{xrid}-{i}" for i in range(3)]
    assert [params["rendezvous"][f"cmpl-{xrid}-{i}"]["remote_cached_tokens"]
            for i in range(3)] == [64, 32, 96]


def _completion_scope(raw: bytes, port: int) -> dict:
    """An ASGI scope for ``POST /v1/completions`` with ``raw`` as its body."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", port),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(raw)).encode())], "state": {}}


def _when_waiting_for_decode(proxy: DisaggProxy) -> threading.Event:
    """Set once the proxy starts waiting for Decode's rendezvous before closing its call."""
    entered = threading.Event()
    real = proxy._decode_registered

    async def spy(job, decode_call=None):  # type: ignore[no-untyped-def]
        entered.set()
        await real(job, decode_call)

    proxy._decode_registered = spy  # type: ignore[method-assign]
    return entered


def _in_thread(proxy: DisaggProxy, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=complete(proxy, body)))
    t.start()
    return t, result


def test_prefill_is_dispatched_beside_decode_once_decode_keeps_its_prefix(backends, proxy):
    """C3, C5: the first completion goes Decode first; its rendezvous names the endpoint
    and says Decode keeps its own prefix, so the next completion reaches Prefill while
    Decode's rendezvous is still held, with that endpoint and no cached tokens."""
    backends.keeps_local_prefix = True
    backends.cached_tokens = (16,)
    r = complete(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text
    (first,) = backends.prefill_calls
    assert first["posts_started"] == 1
    assert first["body"]["kv_transfer_params"]["remote_cached_tokens"] == 16
    backends.rendezvous_gate.clear()
    backends.prefill_arrived.clear()
    prompt = [4, 5, 6, 7]
    t, result = _in_thread(proxy, {"model": "m", "prompt": prompt, "max_tokens": 3})
    assert backends.prefill_arrived.wait(10)
    second = backends.prefill_calls[1]
    assert second["posts_started"] == 1  # Decode has not posted this one yet
    xrid = second["x_request_id"]
    assert second["body"]["kv_transfer_params"] == {
        "request_id": f"cmpl-{xrid}-0", "do_remote_prefill": False, "do_remote_decode": True,
        "remote_engine_id": "d-engine", "remote_host": "127.0.0.1", "remote_port": 20000,
        "remote_tp_size": 1, "remote_pcp_size": 1, "remote_dcp_size": 1,
        "remote_cached_tokens": 0, "metaserver": proxy.metaserver_url}
    backends.rendezvous_gate.set()
    t.join(15)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["token_ids"] == fake_tokens(prompt, 3)
    assert backends.posted[-1] == (f"cmpl-{xrid}-0", 200)
    records = proxy.records(2, timeout=10.0)
    assert [rec["early"] for rec in records] == [False, True]
    assert records[1]["rendezvous_ms"] is not None


def test_no_early_dispatch_while_that_decode_has_not_admitted_an_earlier_one(backends, proxy):
    """C3, C1: a completion sent to a Decode that has not yet posted the rendezvous of one
    sent before goes to Prefill only after its own rendezvous: that Decode may be short of
    KV blocks, and Prefill's READYs for a request it cannot admit would wait (holding
    Prefill's slots) until destination_wait and then fail, where Decode first queues it."""
    backends.keeps_local_prefix = True
    assert complete(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
    backends.rendezvous_gate.clear()
    backends.decode_arrived.clear()
    first, first_result = _in_thread(proxy, {"model": "m", "prompt": [3], "max_tokens": 1})
    assert backends.decode_arrived.wait(10)
    backends.decode_arrived.clear()
    second, second_result = _in_thread(proxy, {"model": "m", "prompt": [4], "max_tokens": 1})
    assert backends.decode_arrived.wait(10)  # its dispatch was decided before this
    backends.rendezvous_gate.set()
    first.join(15)
    second.join(15)
    assert first_result["r"].status_code == second_result["r"].status_code == 200
    assert proxy.wait_idle(10.0)
    by_prompt = {rec["id"]: rec["early"] for rec in proxy.records()}
    calls = {c["body"]["prompt"][0]: f"cmpl-{c['x_request_id']}" for c in backends.prefill_calls}
    assert by_prompt[calls[3]] is True and by_prompt[calls[4]] is False


def _early_by_first_token(proxy: DisaggProxy, backends: Backends,
                          *pending: tuple[threading.Thread, dict]) -> dict[int, bool]:
    """Once the completions still in threads answered 200 and the proxy is idle: whether
    each completion Prefill was sent went early, keyed by its prompt's first token."""
    for t, result in pending:
        t.join(15)
        assert result["r"].status_code == 200, result["r"].text
    assert proxy.wait_idle(10.0)
    early = {rec["id"]: rec["early"] for rec in proxy.records()}
    return {c["body"]["prompt"][0]: early[f"cmpl-{c['x_request_id']}"]
            for c in backends.prefill_calls}


def test_early_dispatch_only_while_decode_has_room(backends, proxy):
    """C3: a Decode short of KV blocks (under ``early_headroom``, 0.1, of them free) or of
    sequence slots would queue the next request, and Prefill's READYs for it would wait
    (holding Prefill's slots) until Decode admits it: that completion goes Decode first.
    The slots a rendezvous told are counted up again as completions there end; a
    rendezvous that tells no room at all counts as none."""
    backends.keeps_local_prefix = True

    def send(first: int, kv: float | None, slots: int | None) -> None:
        backends.free_kv_share, backends.free_seq_slots = kv, slots
        r = complete(proxy, {"model": "m", "prompt": [first, 2], "max_tokens": 1})
        assert r.status_code == 200, r.text

    send(1, 0.05, 16)  # Decode first: no endpoint known yet
    send(2, 0.5, 1)  # Decode first: 5% of the KV blocks free
    send(3, 0.5, 0)  # early: 1 slot told, and #2 has ended since (2 free)
    send(4, None, 16)  # early: #3 ended, its slot is free again
    send(5, 0.5, 16)  # Decode first: #4's rendezvous told nothing
    # #5's rendezvous told room; a completion still open there takes the last slot (its
    # rendezvous says none left), so the next one goes Decode first
    backends.free_seq_slots = 0
    backends.decode_release.clear()
    held, held_result = _in_thread(proxy, {"model": "m", "prompt": [6, 2], "max_tokens": 1})
    assert backends.wait_posted(6, 10)  # #6's rendezvous has told no slot left
    backends.free_seq_slots = 16
    backends.decode_arrived.clear()
    last, last_result = _in_thread(proxy, {"model": "m", "prompt": [7, 2], "max_tokens": 1})
    assert backends.decode_arrived.wait(10)  # #7's dispatch was decided before this
    backends.decode_release.set()
    assert _early_by_first_token(proxy, backends, (held, held_result), (last, last_result)) \
        == {1: False, 2: False, 3: True, 4: True, 5: False, 6: True, 7: False}


def test_a_slot_freed_before_a_later_rendezvous_is_not_counted_twice(backends, proxy):
    """C3: Decode has one sequence slot. #2's answer ends there, #3 takes the slot and its
    rendezvous says none is free, and only then does #2's end reach the proxy. Counting #2's
    slot free again would make one free while #3 still holds it, and #4 would go to Prefill
    early for a Decode that must queue it; the completions still open there, against the
    slots Decode has in all, keep the count exact."""
    backends.keeps_local_prefix = True
    backends.free_seq_slots, backends.seq_slots = 0, 1
    # the fake Decode holds #2 and #3 on the events below only this long, then answers;
    # an early answer would free the slot before the decision it is there for
    backends.decode_wait_s = 40.0

    def body(first: int, **extra: object) -> dict:
        return {"model": "m", "prompt": [first, 2], "max_tokens": 1, **extra}

    r = complete(proxy, body(1))  # Decode first: no endpoint known yet
    assert r.status_code == 200, r.text
    backends.decode_release.clear()
    backends.decode_rest.clear()
    second, second_result = _in_thread(proxy, body(2))  # early: #1 ended, its slot free
    assert backends.wait_posted(2, 10)
    # Decode first (#2 holds the slot); streamed, it then holds its rest until decode_rest
    third, third_result = _in_thread(proxy, body(3, max_tokens=2, stream=True))
    assert backends.wait_posted(3, 10)  # #3's rendezvous: none free
    backends.decode_release.set()  # #2 answers, #3 streams its first token
    second.join(15)
    assert second_result["r"].status_code == 200, second_result["r"].text
    assert len(proxy.records(2, timeout=10.0)) == 2  # #2's end has reached the proxy
    backends.decode_arrived.clear()
    fourth, fourth_result = _in_thread(proxy, body(4))
    assert backends.decode_arrived.wait(10)  # #4's dispatch was decided before this
    backends.decode_rest.set()
    assert _early_by_first_token(proxy, backends, (third, third_result),
                                 (fourth, fourth_result)) == {1: False, 2: True, 3: False,
                                                              4: False}


def test_an_early_dispatch_to_a_changed_decode_fails_that_completion_only(backends, proxy):
    """C3: Prefill was sent the endpoint learned before; a rendezvous naming another (a
    Decode restarted elsewhere) or no longer keeping its prefix (C5) fails the completion
    with both named, and is what the next completion is dispatched by."""
    backends.keeps_local_prefix = True
    assert complete(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
    backends.decode_port = 20001
    backends.decode_release.clear()  # the failure must not race Decode's own answer
    t, result = _in_thread(proxy, {"model": "m", "prompt": [3, 4], "max_tokens": 1})
    assert backends.decode_cancelled.wait(10)  # the proxy closed Decode's request
    backends.decode_release.set()
    t.join(15)
    r = result["r"]
    assert r.status_code == 502, r.text
    assert "'remote_port': 20001" in r.text and "'remote_port': 20000" in r.text
    # the next one goes early to the endpoint now named
    assert complete(proxy, {"model": "m", "prompt": [5], "max_tokens": 1}).status_code == 200
    assert backends.prefill_calls[-1]["body"]["kv_transfer_params"]["remote_port"] == 20001
    # a Decode that stops saying it keeps its prefix fails the completion dispatched early,
    # and is sent Prefill only after its rendezvous from then on
    backends.keeps_local_prefix = False
    backends.decode_cancelled.clear()
    backends.decode_release.clear()
    t, result = _in_thread(proxy, {"model": "m", "prompt": [6], "max_tokens": 1})
    assert backends.decode_cancelled.wait(10)
    backends.decode_release.set()
    t.join(15)
    assert result["r"].status_code == 502 and "C5: False" in result["r"].text
    calls = len(backends.prefill_calls)
    assert complete(proxy, {"model": "m", "prompt": [7], "max_tokens": 1}).status_code == 200
    assert len(backends.prefill_calls) == calls + 1
    assert backends.prefill_calls[-1]["posts_started"] == backends.posts_started
    assert [rec["early"] for rec in proxy.records(5, timeout=10.0)] == [
        False, True, True, True, False]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_decode_registered_an_early_completion(backends, proxy, stream):
    """C1, C3: Prefill was sent the completion early and may already push READYs for it; a
    request closed before Decode's engine saw it would never be registered, leaving those
    READYs to hold Prefill's slots until Decode's destination_wait ran out. So the proxy
    closes Decode's call only once Decode's rendezvous came (driven as an ASGI call: the
    client leaves while the proxy waits for Decode's headers, or before the body began)."""
    backends.keeps_local_prefix = True
    assert complete(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
    backends.rendezvous_gate.clear()
    backends.decode_release.clear()
    entered = _when_waiting_for_decode(proxy)
    raw = json.dumps({"model": "m", "prompt": [3, 4], "max_tokens": 2,
                      "stream": stream}).encode()
    scope = _completion_scope(raw, 1)

    async def drive() -> None:
        receives = 0
        never = asyncio.Event()

        async def receive() -> dict:
            nonlocal receives
            receives += 1
            if receives == 1:
                return {"type": "http.request", "body": raw, "more_body": False}
            if receives == 2 and stream:  # the watch while Decode's headers come
                await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            return None

        await proxy.app(scope, receive, send)

    assert proxy._loop is not None
    done = asyncio.run_coroutine_threadsafe(drive(), proxy._loop)
    assert entered.wait(10)
    assert not backends.decode_cancelled.is_set()  # Decode's call is held open ...
    backends.rendezvous_gate.set()  # ... until its rendezvous comes
    assert backends.decode_cancelled.wait(10)
    done.result(timeout=10)
    assert proxy.wait_idle(5.0)
    assert backends.posts_started == 2
    last = proxy.records()[-1]
    assert last["outcome"] == "client gone" and last["early"] is True


def _failed_by_prefill_before_its_rendezvous(backends, proxy) -> None:  # type: ignore[no-untyped-def]
    """An early completion that Prefill fails before Decode posted its rendezvous: the
    proxy waits for that rendezvous, then the client gets Prefill's error."""
    backends.prefill_mode = "error"
    backends.rendezvous_gate.clear()
    backends.decode_release.clear()
    entered = _when_waiting_for_decode(proxy)
    t, result = _in_thread(proxy, {"model": "m", "prompt": [3], "max_tokens": 1})
    assert entered.wait(10)  # Prefill failed it; the proxy waits for Decode's rendezvous
    backends.rendezvous_gate.set()
    t.join(15)
    r = result["r"]
    assert r.status_code == 502 and "prefill exploded" in r.text, r.text


def test_an_early_completion_failed_by_prefill_still_learns_decode_registered(backends, proxy):
    """C3, F1: Prefill fails an early completion before Decode posted its rendezvous; the
    proxy holds Decode's call until that rendezvous (it may already have READYs waiting),
    which is answered 409 since the completion failed but still counts as Decode having
    registered, so the client gets Prefill's error rather than waiting out the rendezvous
    timeout."""
    backends.keeps_local_prefix = True
    assert complete(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
    _failed_by_prefill_before_its_rendezvous(backends, proxy)
    assert backends.decode_cancelled.wait(10)
    assert proxy.records(2, timeout=10.0)[-1]["early"] is True


def test_a_failed_early_completion_still_teaches_what_its_decode_told(backends, proxy):
    """C3: Prefill fails a completion dispatched early before Decode's rendezvous came, and
    Decode, restarted elsewhere meanwhile, names its new endpoint in that rendezvous. The
    proxy learns it all the same (and the room told with it, whose slots it counts free
    again when the completion ends): the next completion goes early to the new endpoint
    and succeeds. Before, that rendezvous was answered unread, and the next one went to the
    old endpoint and failed."""
    backends.keeps_local_prefix = True
    assert complete(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
    backends.decode_port = 20001
    _failed_by_prefill_before_its_rendezvous(backends, proxy)
    assert backends.prefill_calls[-1]["body"]["kv_transfer_params"]["remote_port"] == 20000
    backends.prefill_mode = "ok"
    backends.decode_release.set()
    r = complete(proxy, {"model": "m", "prompt": [5], "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert backends.prefill_calls[-1]["body"]["kv_transfer_params"]["remote_port"] == 20001
    assert [rec["early"] for rec in proxy.records(3, timeout=10.0)] == [False, True, True]


def test_without_early_dispatch_prefill_waits_for_every_rendezvous(backends):
    backends.keeps_local_prefix = True
    proxy = make_proxy(backends, early_dispatch=False)
    try:
        for n in (1, 2):
            r = complete(proxy, {"model": "m", "prompt": [n, 9], "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert backends.prefill_calls[-1]["posts_started"] == n
        assert [rec["early"] for rec in proxy.records(2, timeout=10.0)] == [False, False]
    finally:
        proxy.close()


def test_internal_ids_with_the_engine_suffix_are_accepted(backends, proxy):
    backends.post_internal_ids = True
    r = complete(proxy, {"model": "m", "prompt": [[1, 2], [3, 4]], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [status for _, status in backends.posted] == [200, 200]
    assert all(len(rid.rsplit("-", 1)[1]) == 8 for rid, _ in backends.posted)


def test_prefill_params_for_prompt_lists():
    def rdv(i: int, port: int = 5000, cached: int = 0) -> dict:
        return Rendezvous(request_id=f"cmpl-x-{i}", remote_engine_id="d", remote_host="h",
                          remote_port=port, remote_tp_size=2,
                          remote_cached_tokens=cached).to_json()

    assert prefill_params([rdv(0, cached=32)]) == rdv(0, cached=32)
    merged = prefill_params([rdv(0, cached=32), rdv(1, cached=0)])
    assert merged["remote_port"] == 5000 and merged["remote_tp_size"] == 2
    assert merged["remote_cached_tokens"] == 0
    assert merged["rendezvous"]["cmpl-x-0"]["remote_cached_tokens"] == 32
    with pytest.raises(ValueError, match="remote_port"):
        prefill_params([rdv(0), rdv(1, port=5001)])


def test_streaming_is_passed_through(backends, proxy):
    prompt = [3, 4, 5]
    with httpx.stream("POST", f"{proxy.url}/v1/completions", trust_env=False, timeout=20,
                      json={"model": "m", "prompt": prompt, "max_tokens": 4,
                            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    tokens = [json.loads(ln[6:])["choices"][0]["token_ids"][0] for ln in lines[:-1]]
    assert tokens == fake_tokens(prompt, 4)


def test_prefill_error_reaches_client_and_aborts_decode(backends, proxy):
    backends.prefill_mode = "error"
    t0 = time.monotonic()
    r = complete(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3})
    assert r.status_code == 502
    assert "prefill" in r.json()["error"]["message"]
    assert "500" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < backends.decode_wait_s  # not Decode's own timeout
    assert backends.decode_cancelled.wait(5.0)  # the Decode request was aborted


def test_streaming_prefill_error_ends_the_stream_with_an_error_event(backends, proxy):
    backends.prefill_mode = "error"
    with httpx.stream("POST", f"{proxy.url}/v1/completions", trust_env=False, timeout=20,
                      json={"model": "m", "prompt": [1, 2], "max_tokens": 2,
                            "stream": True}) as r:
        # Decode's stream started (headers), then Prefill failed before any token.
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 502 and "prefill" in error["message"]
    assert len(lines) == 2  # no token before the error
    assert backends.decode_cancelled.wait(5.0)


@pytest.mark.parametrize("when", ["before the body began", "while it stopped reading",
                                  "between two tokens"])
def test_a_client_gone_ends_its_job_and_aborts_decode_at_once(backends, proxy, when):
    # Driven as an ASGI call on the proxy's own loop, so the disconnect lands in the same
    # place every time. "before the body began": after Decode's headers reached the proxy,
    # while the body waits for Decode's first token. "while it stopped reading": the client
    # took the first chunk and no more, so the body generator sat at a yield when the
    # response was cancelled, and its cleanup waited for the garbage collector (the job
    # outlived the client; the bench counted such jobs after its turns). Both must end the
    # job now. "between two tokens": the client took the first chunk and left while Decode
    # had not sent the next one, so the relay's read is what Starlette cancels. uvicorn says
    # ASGI spec 2.3: Starlette watches for the disconnect itself.
    early = when == "before the body began"
    stuck = when == "while it stopped reading"
    if early:
        backends.decode_release.clear()  # Decode's stream stays open, no token yet
    if when == "between two tokens":
        backends.decode_rest.clear()  # its first token sent, the next one not yet
    raw = json.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": 8,
                      "stream": True}).encode()
    scope = _completion_scope(raw, int(proxy.url.rsplit(":", 1)[1]))
    receives = 0

    async def drive() -> list[dict]:
        sent: list[dict] = []
        never = asyncio.Event()
        got_chunk = asyncio.Event()
        gone = asyncio.Event()

        async def receive() -> dict:
            nonlocal receives
            receives += 1
            if receives == 1:
                return {"type": "http.request", "body": raw, "more_body": False}
            if receives == 2:  # the proxy's watch while it waits for Decode's headers
                await never.wait()
            if not early:
                await got_chunk.wait()
            gone.set()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                got_chunk.set()
                if stuck:
                    # A client that stopped reading: the send waits for the socket to
                    # drain until Starlette cancels it on the disconnect (uvicorn releases
                    # the wait when the connection is lost, and the cancel may come first).
                    await never.wait()
                await gone.wait()

        await proxy.app(scope, receive, send)
        return sent

    assert proxy._loop is not None
    sent = asyncio.run_coroutine_threadsafe(drive(), proxy._loop).result(timeout=10.0)
    assert receives >= 3  # the disconnect came after the proxy's own watch ended
    chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert len(chunks) == (0 if early else 1)
    assert proxy.wait_idle(5.0) and proxy.jobs_in_flight == 0
    if not stuck:  # Decode's request, waiting for its KV or its next token, was aborted
        assert backends.decode_cancelled.wait(5.0)
    (job,) = proxy.records()
    assert job["outcome"] == "client gone"


def test_missing_rendezvous_times_out_with_504(backends):
    backends.decode_mode = "no_rendezvous"
    proxy = make_proxy(backends, rendezvous_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        r = complete(proxy, {"model": "m", "prompt": [[1], [2]], "max_tokens": 2})
        assert r.status_code == 504
        assert "0 of 2 sub-requests" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5.0
        assert backends.decode_cancelled.wait(5.0)
        assert backends.prefill_calls == []
    finally:
        proxy.close()


def test_decode_error_is_forwarded(backends, proxy):
    backends.decode_mode = "error"
    r = complete(proxy, {"model": "m", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 500
    # Decode's words, and as it failed before posting a rendezvous, what to check (C1)
    message = r.json()["error"]["message"]
    assert "(decode exploded)" in message and proxy.metaserver_url in message
    assert "--advertise-host" in message


def test_unreachable_decode_is_a_502():
    proxy = DisaggProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    proxy.start()
    try:
        r = complete(proxy, {"model": "m", "prompt": [1], "max_tokens": 1})
        assert r.status_code == 502
        assert "decode" in r.json()["error"]["message"]
    finally:
        proxy.close()


@pytest.mark.parametrize("body,status", [
    ({"prompt": [], "max_tokens": 1}, 400),
    ({"prompt": [1], "n": 2}, 400),
    ({"prompt": [1], "kv_transfer_params": {"do_remote_decode": True}}, 400),
])
def test_bad_completions_are_400(proxy, body, status):
    r = complete(proxy, body)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status


def test_metaserver_contract(backends, proxy):
    meta = proxy.metaserver_url
    rdv = Rendezvous(request_id="cmpl-nobody-0", remote_engine_id="e", remote_host="127.0.0.1",
                     remote_port=1234, remote_tp_size=1)
    assert post_rendezvous(meta, rdv) == 404  # F1: an HTTP error counts as delivered
    r = httpx.post(meta, content=b"{not json", trust_env=False)
    assert r.status_code == 400
    r = httpx.post(meta, json={"request_id": "x", "remote_host": "0.0.0.0"}, trust_env=False)
    assert r.status_code == 400 and "remote_engine_id" in r.json()["error"]

    # After a completion its ids are forgotten: a late post is 404, never a hang.
    r = complete(proxy, {"model": "m", "prompt": [9, 9], "max_tokens": 1})
    assert r.status_code == 200
    # Forgotten once Prefill's answer is in too, which may trail the client's own answer.
    assert proxy.wait_idle(10.0)
    ((rid, _),) = backends.posted
    late = Rendezvous(request_id=rid, remote_engine_id="d-engine", remote_host="127.0.0.1",
                      remote_port=20000, remote_tp_size=1)
    assert post_rendezvous(meta, late) == 404


def test_duplicate_and_conflicting_rendezvous_after_dispatch(backends, proxy):
    # A Decode that does not post by itself: the test posts for it.
    backends.decode_mode = "no_rendezvous"
    backends.decode_wait_s = 10.0
    # Decode holds its answer: once it answered, the proxy forgets the request (404)
    backends.decode_release.clear()
    t, result = _in_thread(proxy, {"model": "m", "prompt": [5, 6], "max_tokens": 1})
    assert backends.decode_arrived.wait(10)
    xrid = backends.decode_calls[0]["x_request_id"]
    rid = f"cmpl-{xrid}-0"
    first = Rendezvous(request_id=rid, remote_engine_id="d", remote_host="127.0.0.1",
                       remote_port=3000, remote_tp_size=1)
    other = Rendezvous(request_id=rid, remote_engine_id="d", remote_host="127.0.0.1",
                       remote_port=3001, remote_tp_size=1)
    assert post_rendezvous(proxy.metaserver_url, first) == 200
    assert post_rendezvous(proxy.metaserver_url, first) == 200  # duplicate
    assert post_rendezvous(proxy.metaserver_url, other) == 409
    backends.decode_release.set()
    t.join(15)
    assert result["r"].status_code == 200  # the fake Prefill pushed for `first`
    (p_call,) = backends.prefill_calls
    assert p_call["body"]["kv_transfer_params"]["remote_port"] == 3000


def test_close_answers_in_flight_requests_within_its_deadline(backends):
    backends.decode_mode = "no_rendezvous"
    proxy = make_proxy(backends, rendezvous_timeout_s=60)
    t, result = _in_thread(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 1})
    assert backends.decode_arrived.wait(10)
    t0 = time.monotonic()
    proxy.close(timeout=5.0)
    assert time.monotonic() - t0 < 5.5
    t.join(5)
    assert result["r"].status_code == 503
    assert backends.decode_cancelled.wait(5.0)


def test_early_headroom_must_be_a_share():
    with pytest.raises(ValueError, match="early_headroom must lie in 0..1, got 1.5"):
        DisaggProxy(["http://p"], ["http://d"], early_headroom=1.5)
    with pytest.raises(SystemExit):
        proxy_main(["--prefill", "http://p", "--decode", "http://d", "--early-headroom", "-1"])


def test_wildcard_host_needs_an_advertised_address():
    with pytest.raises(ValueError, match="wildcard"):
        DisaggProxy(["http://p"], ["http://d"], host="0.0.0.0")
    proxy = DisaggProxy(["p:1"], ["d:2"], host="0.0.0.0", advertise_host="10.0.0.5")
    assert proxy.prefill == ["http://p:1"] and proxy.decode == ["http://d:2"]


class _ClosingAfterOneAnswer:
    """A TCP relay in front of a fake engine that behaves like a server closing an idle
    keep-alive connection at the instant the next request arrives: each connection carries
    its first request and answer through, and the next bytes the client sends on it are
    answered with a reset (RST), as uvicorn's close with unread data gives."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        self.resets = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self._upstream)
        answered = False
        with selectors.DefaultSelector() as sel, client, upstream:
            sel.register(client, selectors.EVENT_READ)
            sel.register(upstream, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.fileobj is upstream:
                        answered = True
                        client.sendall(data)
                    elif answered:  # a second request on this connection
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                          struct.pack("ii", 1, 0))
                        with self._lock:
                            self.resets += 1
                        return
                    else:
                        upstream.sendall(data)

    def close(self) -> None:
        self._listener.close()


def test_every_engine_call_has_a_connection_of_its_own(backends) -> None:
    """A completion call sent on a pooled connection the engine closes that instant is
    reset, and the proxy cannot retry it (the prompt may already run): seen under load as a
    502 from a healthy Prefill. Behind engines that reset every reused connection, each of
    several completions in a row must still succeed, each call on a fresh connection."""
    assert backends.prefill is not None and backends.decode is not None
    prefill = _ClosingAfterOneAnswer(backends.prefill.url)
    decode = _ClosingAfterOneAnswer(backends.decode.url)
    proxy = DisaggProxy([prefill.url], [decode.url])
    proxy.start()
    try:
        for n in range(4):
            prompt = [7, n, 3]
            r = complete(proxy, {"model": "m", "prompt": prompt, "max_tokens": 3})
            assert r.status_code == 200, (n, r.text)
            assert r.json()["choices"][0]["token_ids"] == fake_tokens(prompt, 3)
        models = httpx.get(f"{proxy.url}/v1/models", timeout=10, trust_env=False)
        assert models.status_code == 200, models.text
    finally:
        proxy.close()
        prefill.close()
        decode.close()
    assert (prefill.resets, decode.resets) == (0, 0)
    assert (prefill.connections, decode.connections) == (4, 5)
