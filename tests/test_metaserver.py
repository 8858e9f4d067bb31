"""Metaserver tests over real HTTP on loopback: the D-first rendezvous flow (C1, C3), F1
retry semantics of ``post_rendezvous``, rendezvous validation, and bad HTTP input."""

from __future__ import annotations

import http.client
import inspect
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from errno import ECONNRESET, EPIPE
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sfa_rd2h.runtime import metaserver
from sfa_rd2h.runtime.metaserver import (
    MetaserverUnreachable,
    ProxyRequestError,
    ProxyServer,
    Rendezvous,
    RendezvousError,
    fetch_work,
    post_rendezvous,
    report_finished,
)
from sfa_rd2h.runtime.ports import free_port
from sfa_rd2h.spec.errors import ProtocolError
from sfa_rd2h.spec.wire import MAX_ID_LEN

WAIT = 10.0  # upper bound for anything awaited; never slept


def _rdv(request_id: str, **kw: Any) -> Rendezvous:
    base: dict[str, Any] = dict(
        request_id=request_id,
        remote_engine_id="d-engine-0",
        remote_host="127.0.0.1",
        remote_port=30000,
        remote_tp_size=2,
        remote_cached_tokens=16,
    )
    base.update(kw)
    return Rendezvous(**base)


def _response(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request on a connection of its own: the status, the headers and the raw body."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def _raw(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    status, _, raw = _response(url, method, path, body, headers)
    return status, json.loads(raw)


@pytest.fixture
def proxy():
    with ProxyServer() as server:
        yield server


# --------------------------------------------------------------------------- Rendezvous


def test_rendezvous_roundtrip_and_wire_keys() -> None:
    rdv = _rdv("req-1")
    obj = rdv.to_json()
    assert obj == {
        "request_id": "req-1",
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_engine_id": "d-engine-0",
        "remote_host": "127.0.0.1",
        "remote_port": 30000,
        "remote_tp_size": 2,
        "remote_pcp_size": 1,
        "remote_dcp_size": 1,
        "remote_cached_tokens": 16,
    }
    assert Rendezvous.from_json(json.loads(json.dumps(obj))) == rdv


def test_a_decode_that_keeps_its_prefix_says_so_and_only_then() -> None:  # C5, C3
    """The flag travels only when true, so a rendezvous without it reads as before (an
    upstream Decode's) and one with it round-trips."""
    keeps = _rdv("req-1", keeps_local_prefix=True)
    assert keeps.to_json() == _rdv("req-1").to_json() | {"keeps_local_prefix": True}
    assert Rendezvous.from_json(json.loads(json.dumps(keeps.to_json()))) == keeps
    assert _rdv("req-1").keeps_local_prefix is False
    with pytest.raises(RendezvousError, match="'keeps_local_prefix'"):
        Rendezvous.from_json(_rdv("req-1").to_json() | {"keeps_local_prefix": "yes"})


def test_decode_room_is_said_only_when_known() -> None:  # C3
    told = _rdv("req-1", free_kv_share=0.25, free_seq_slots=3, seq_slots=8)
    assert told.to_json() == _rdv("req-1").to_json() | {"free_kv_share": 0.25,
                                                       "free_seq_slots": 3, "seq_slots": 8}
    assert Rendezvous.from_json(json.loads(json.dumps(told.to_json()))) == told
    assert (_rdv("req-1").free_kv_share, _rdv("req-1").free_seq_slots,
            _rdv("req-1").seq_slots) == (None, None, None)
    # each may come alone (a build that tells no total); every slot free is room too
    assert _rdv("req-1", seq_slots=8).to_json() == _rdv("req-1").to_json() | {"seq_slots": 8}
    assert _rdv("req-1", free_seq_slots=8, seq_slots=8).free_seq_slots == 8
    with pytest.raises(RendezvousError, match="'free_seq_slots': 9 free of 8 sequence slots"):
        _rdv("req-1", free_seq_slots=9, seq_slots=8)
    for edge in (0, 1):  # the bounds are room too; an integer reads as a float
        share = Rendezvous.from_json(_rdv("req-1").to_json() | {"free_kv_share": edge})
        assert share.free_kv_share == edge and isinstance(share.free_kv_share, float)
    assert Rendezvous.from_json(_rdv("req-1").to_json() | {"free_seq_slots": 0}) \
        .free_seq_slots == 0
    for name, bad, why in (("free_kv_share", 1.5, "1.5 is outside 0..1"),
                           ("free_kv_share", float("nan"), "nan is outside 0..1"),
                           ("free_kv_share", True, "expected a number, got bool"),
                           ("free_kv_share", "0.5", "expected a number, got str"),
                           ("free_seq_slots", -1, "-1 is outside 0..2147483647"),
                           ("free_seq_slots", 2**31, "2147483648 is outside 0..2147483647"),
                           ("free_seq_slots", 2.0, "expected an integer, got float"),
                           ("seq_slots", 0, "0 is outside 1..2147483647"),
                           ("seq_slots", "8", "expected an integer, got str")):
        with pytest.raises(RendezvousError, match=f"'{name}': {why}"):
            Rendezvous.from_json(_rdv("req-1").to_json() | {name: bad})


@pytest.mark.parametrize("value", ["absent", None])
def test_missing_remote_cached_tokens_defaults_to_zero(value: object) -> None:
    # Known failure 7: never a KeyError on a missing remote_cached_tokens.
    obj = _rdv("req-1").to_json()
    if value == "absent":
        del obj["remote_cached_tokens"]
    else:
        obj["remote_cached_tokens"] = value
    assert Rendezvous.from_json(obj).remote_cached_tokens == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_id", ""),
        ("request_id", 7),
        ("request_id", "x" * 1025),
        ("remote_engine_id", None),
        ("remote_host", "0.0.0.0"),
        ("remote_host", "host name"),
        ("remote_port", "30000"),
        ("remote_port", 0),
        ("remote_port", 65536),
        ("remote_port", True),
        ("remote_port", 30000.0),
        ("remote_port", 65535),  # with tp 2 the highest rank port is 65536 (P2)
        ("remote_tp_size", 0),
        ("remote_pcp_size", 2),
        ("remote_dcp_size", 4),
        ("remote_cached_tokens", -1),
        ("do_remote_prefill", True),
        ("do_remote_decode", False),
        ("do_remote_decode", "true"),
    ],
)
def test_rendezvous_rejects_bad_field(field: str, value: object) -> None:
    obj = _rdv("req-1").to_json()
    obj[field] = value
    with pytest.raises(RendezvousError, match=f"'{field}'") as info:
        Rendezvous.from_json(obj)
    assert info.value.field == field
    assert isinstance(info.value, ProtocolError)


@pytest.mark.parametrize(
    "field", ["request_id", "remote_engine_id", "remote_host", "remote_port", "remote_tp_size"]
)
def test_rendezvous_requires_field(field: str) -> None:
    obj = _rdv("req-1").to_json()
    del obj[field]
    with pytest.raises(RendezvousError, match=f"'{field}': is required"):
        Rendezvous.from_json(obj)


def test_rendezvous_rejects_non_object_and_bad_construction() -> None:
    with pytest.raises(RendezvousError, match="expected a JSON object"):
        Rendezvous.from_json([1, 2])
    with pytest.raises(RendezvousError, match="'remote_port'"):
        _rdv("req-1", remote_port=-5)


def test_rendezvous_ignores_unknown_keys() -> None:
    obj = _rdv("req-1").to_json() | {"future_field": [1, 2]}
    assert Rendezvous.from_json(obj) == _rdv("req-1")


# --------------------------------------------------------------------------- D-first flow


def test_d_first_flow_three_prompts(proxy: ProxyServer) -> None:
    url = proxy.url
    prompts = ["alpha", "beta gamma", "délta"]
    decode_got: list[list[dict[str, Any]]] = []
    prefill_got: list[list[dict[str, Any]]] = []
    errors: list[BaseException] = []
    two_posted = threading.Event()
    go = threading.Event()

    def decode() -> None:
        try:
            items = fetch_work(url, "decode", "d0", timeout=WAIT)  # woken by submit()
            decode_got.append(items)
            for item in items[:2]:
                assert post_rendezvous(item["metaserver"], _rdv(item["request_id"])) == 200
            two_posted.set()
            assert go.wait(WAIT)
            assert post_rendezvous(items[2]["metaserver"], _rdv(items[2]["request_id"])) == 200
            for item in items:
                report_finished(url, item["request_id"], ok=True, role="decode")
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
            two_posted.set()

    def prefill() -> None:
        try:
            jobs = fetch_work(url, "prefill", "p0", timeout=WAIT)
            prefill_got.append(jobs)
            for job in jobs:
                for req in job["requests"]:
                    report_finished(url, req["request_id"], ok=True, role="prefill")
        except BaseException as exc:
            errors.append(exc)

    d_thread = threading.Thread(target=decode)
    d_thread.start()
    job_id = proxy.submit(prompts, "d0", "p0")
    ids = [f"{job_id}-{i}" for i in range(3)]
    assert two_posted.wait(WAIT)
    assert not errors, errors

    # Decode saw one sub-request per prompt (C3), each with the metaserver to post to.
    [items] = decode_got
    assert [i["request_id"] for i in items] == ids
    assert [i["prompt"] for i in items] == prompts
    assert [i["num_tokens"] for i in items] == [5, 10, 6]  # UTF-8 bytes
    assert {i["metaserver"] for i in items} == {proxy.metaserver_url}
    assert items[0]["kv_transfer_params"]["do_remote_prefill"] is True

    # Two of three posted: nothing for Prefill yet.
    status = proxy.status(job_id)
    assert [r["state"] for r in status["requests"]] == ["rendezvous", "rendezvous", "at_decode"]
    assert status["dispatched"] is False
    assert fetch_work(url, "prefill", "p0", timeout=0) == []

    p_thread = threading.Thread(target=prefill)
    p_thread.start()
    go.set()
    d_thread.join(WAIT)
    p_thread.join(WAIT)
    assert not d_thread.is_alive() and not p_thread.is_alive()
    assert not errors, errors

    [[job]] = prefill_got
    assert job["job"] == job_id
    assert job["prompts"] == prompts
    assert (job["max_completion_tokens"], job["min_tokens"]) == (1, 1)
    assert [r["request_id"] for r in job["requests"]] == ids
    for req in job["requests"]:
        assert Rendezvous.from_json(req["kv_transfer_params"]) == _rdv(req["request_id"])

    # A repeated rendezvous is idempotent: 200, and no second dispatch.
    assert post_rendezvous(proxy.metaserver_url, _rdv(ids[1])) == 200
    assert fetch_work(url, "prefill", "p0", timeout=0) == []
    # A different one after dispatch is refused (Prefill already has the first).
    assert post_rendezvous(proxy.metaserver_url, _rdv(ids[1], remote_port=31000)) == 409

    done = proxy.wait_job(job_id, WAIT)
    assert done["done"] is True and done["ok"] is True
    assert [r["state"] for r in done["requests"]] == ["done"] * 3
    http_status, body = _raw(url, "GET", f"/v1/status?job={job_id}")
    assert http_status == 200 and body == done


def test_single_prompt_failure_and_finished_checks(proxy: ProxyServer) -> None:
    url = proxy.url
    job_id = proxy.submit("hello", "d1", "p1", job_id="job-x")
    [item] = fetch_work(url, "decode", "d1", timeout=0)
    assert item["request_id"] == "job-x-0"
    assert fetch_work(url, "decode", "d1", timeout=0) == []  # handed out once

    with pytest.raises(TimeoutError, match="job-x"):
        proxy.wait_job(job_id, 0)
    with pytest.raises(ProxyRequestError) as info:
        report_finished(url, "job-x-0", ok=True, role="prefill")
    assert info.value.status == 409 and "never dispatched" in str(info.value)

    report_finished(url, "job-x-0", ok=False, role="decode", error="no blocks")
    report_finished(url, "job-x-0", ok=False, role="decode")  # duplicate, same outcome
    with pytest.raises(ProxyRequestError) as info:
        report_finished(url, "job-x-0", ok=True, role="decode")
    assert info.value.status == 409
    status = proxy.wait_job(job_id, WAIT)
    assert status["done"] is True and status["ok"] is False
    assert status["requests"][0]["state"] == "failed"
    assert status["requests"][0]["errors"] == {"decode": "no blocks"}

    with pytest.raises(ValueError, match="already in use"):
        proxy.submit("again", "d1", "p1", job_id="job-x")
    with pytest.raises(ValueError, match="prompt 1"):
        proxy.submit(["ok", ""], "d1", "p1")
    with pytest.raises(ValueError, match="not be empty"):
        proxy.submit([], "d1", "p1")
    with pytest.raises(KeyError, match="unknown job"):
        proxy.wait_job("nope", 0)


def test_vllm_style_post_without_cached_tokens_reaches_prefill_as_zero(
    proxy: ProxyServer,
) -> None:
    job_id = proxy.submit(["a"], "d0", "p0", job_id="job-v")
    body = _rdv(f"{job_id}-0").to_json()
    del body["remote_cached_tokens"]
    del body["do_remote_prefill"]
    status, reply = _raw(
        proxy.url,
        "POST",
        "/v1/metaserver",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    assert (status, reply) == (200, {"status": "ok"})
    [job] = fetch_work(proxy.url, "prefill", "p0", timeout=0)
    params = job["requests"][0]["kv_transfer_params"]
    assert params["remote_cached_tokens"] == 0
    assert Rendezvous.from_json(params).remote_cached_tokens == 0


# --------------------------------------------------------------------------- bad HTTP input


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (
            b'{"request_id": "r", "remote_engine_id": "e", "remote_host": "h", '
            b'"remote_port": "abc", "remote_tp_size": 1}',
            "'remote_port'",
        ),
        (b'{"remote_engine_id": "e"}', "'request_id'"),
    ],
)
def test_metaserver_bad_body_is_400(proxy: ProxyServer, body: bytes, needle: str) -> None:
    status, reply = _raw(proxy.url, "POST", "/v1/metaserver", body)
    assert status == 400
    assert needle in reply["error"]


def test_bad_http_requests(proxy: ProxyServer) -> None:
    url = proxy.url
    big = {"Content-Length": str(2 * 1024 * 1024)}
    assert _raw(url, "POST", "/v1/metaserver", b"{}", big)[0] == 413
    status, reply = _raw(
        url, "POST", "/v1/metaserver", json.dumps(_rdv("ghost-0").to_json()).encode()
    )
    assert status == 404 and "ghost-0" in reply["error"]
    assert _raw(url, "GET", "/v1/decode_work?timeout=0")[0] == 400
    status, reply = _raw(url, "GET", "/v1/decode_work?instance=d0&timeout=abc")
    assert status == 400 and "timeout" in reply["error"]
    assert _raw(url, "GET", "/v1/prefill_work?instance=p0&timeout=-1")[0] == 400
    assert _raw(url, "GET", "/v1/status?job=nope")[0] == 404
    assert _raw(url, "GET", "/v1/nothing")[0] == 404
    assert _raw(url, "POST", "/v1/nothing", b"{}")[0] == 404
    status, reply = _raw(url, "POST", "/v1/finished", b'{"request_id": "r", "ok": 1}')
    assert status == 400 and "'ok'" in reply["error"]
    status, reply = _raw(
        url, "POST", "/v1/finished", b'{"request_id": "r", "ok": true, "role": "judge"}'
    )
    assert status == 400 and "'role'" in reply["error"]
    assert _raw(url, "GET", "/v1/health") == (200, {"status": "ok"})


def test_long_poll_times_out_empty_and_close_is_bounded() -> None:
    server = ProxyServer()
    url = server.start()
    assert fetch_work(url, "decode", "idle", timeout=0.1) == []
    outcome: list[object] = []

    def poll() -> None:
        try:
            outcome.append(fetch_work(url, "prefill", "idle", timeout=30))
        except (ProxyRequestError, OSError) as exc:
            outcome.append(exc)

    t = threading.Thread(target=poll)
    t.start()
    start = time.monotonic()
    server.close()
    t.join(WAIT)
    assert not t.is_alive()
    assert time.monotonic() - start < 5.0
    # Either the poll was waiting and got 503, or it arrived after close and was refused;
    # it never got a work list.
    [result] = outcome
    assert not isinstance(result, list)
    if isinstance(result, ProxyRequestError):
        assert result.status == 503
    server.close()  # idempotent


# --------------------------------------------------------------------------- F1


def test_f1_retries_refused_then_succeeds_when_server_comes_up() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/metaserver"
    servers: list[ProxyServer] = []
    delays: list[float] = []

    def sleep(delay: float) -> None:
        delays.append(delay)
        if not servers:  # the proxy comes up while Decode backs off
            server = ProxyServer(port=port)
            server.start()
            server.submit("x", "d0", "p0", job_id="job-f1")
            servers.append(server)

    try:
        assert post_rendezvous(url, _rdv("job-f1-0"), sleep=sleep) == 200
        assert delays == [0.05]
        assert servers[0].status("job-f1")["requests"][0]["rendezvous"] is True
    finally:
        for s in servers:
            s.close()


def test_f1_gives_up_after_retries_with_exponential_backoff() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/metaserver"
    delays: list[float] = []
    with pytest.raises(MetaserverUnreachable, match="after 4 attempt") as info:
        post_rendezvous(url, _rdv("r-0"), retries=3, backoff=0.5, sleep=delays.append)
    assert delays == [0.5, 1.0, 2.0]
    assert info.value.attempts == 4
    assert isinstance(info.value, ConnectionError)


def test_f1_timeout_is_a_transport_error() -> None:
    # A listener that never accepts: the connect completes in the backlog, the response
    # never comes, so each attempt ends in a timeout.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/metaserver"
        delays: list[float] = []
        with pytest.raises(MetaserverUnreachable, match="after 2 attempt"):
            post_rendezvous(url, _rdv("r-0"), retries=1, timeout=0.2, sleep=delays.append)
        assert delays == [0.05]


def test_f1_http_error_response_counts_as_delivered() -> None:
    hits: list[bytes] = []

    class Old(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            hits.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Old)
    t = threading.Thread(target=server.serve_forever)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver"
        slept: list[float] = []
        assert post_rendezvous(url, _rdv("r-0"), sleep=slept.append) == 500
        assert slept == []
        assert len(hits) == 1
        assert json.loads(hits[0]) == _rdv("r-0").to_json()
    finally:
        server.shutdown()
        server.server_close()
        t.join(WAIT)


def test_f1_a_busy_metaserver_is_asked_again_until_it_takes_the_rendezvous() -> None:
    """Every handler of the metaserver is taken, so it answers 503 without reading the
    rendezvous: a 503 says nothing was taken, and the client retries it like a transport
    error (before, it counted as delivered, and the request waited out its deadline). Once
    a handler is free, the retry is read (404 here: no job names this id)."""
    with ProxyServer(max_handlers=2, max_poll_s=5.0) as proxy:
        address = urllib.parse.urlsplit(proxy.url).netloc.rsplit(":", 1)
        held = [socket.create_connection((address[0], int(address[1]))) for _ in range(2)]
        slept: list[float] = []

        def free_the_handlers(delay: float) -> None:
            slept.append(delay)
            while held:
                held.pop().close()
            time.sleep(delay)

        try:
            status = post_rendezvous(proxy.metaserver_url, _rdv("r-busy"), retries=8,
                                     backoff=0.05, timeout=2.0, sleep=free_the_handlers)
        finally:
            for s in held:
                s.close()
        assert status == 404, status
        assert slept, "answered before a handler was free: the connections were not held"


def test_post_rendezvous_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="http"):
        post_rendezvous("ftp://x/v1/metaserver", _rdv("r-0"))
    with pytest.raises(TypeError, match="Rendezvous"):
        post_rendezvous("http://127.0.0.1:1/", {"request_id": "r"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retries"):
        post_rendezvous("http://127.0.0.1:1/", _rdv("r-0"), retries=-1)


def _dribble(url: str, stop: threading.Event, connected: threading.Event | None = None) -> None:
    """A client that sends a request one byte at a time, just inside the socket timeout."""
    host, port = urllib.parse.urlsplit(url).netloc.rsplit(":", 1)
    body = b'{"request_id": "x"}'
    head = (f"POST /v1/metaserver HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode())
    try:
        with socket.create_connection((host, int(port)), timeout=30) as s:
            if connected is not None:
                connected.set()
            for b in head + body:
                if stop.wait(0.3):
                    return
                s.sendall(bytes([b]))
    except OSError:
        pass  # cut by the server: what the test wants


def test_a_dribbling_client_cannot_hold_the_proxy_past_close_or_its_deadline() -> None:
    """Issue: a slow client kept the demo alive 131 s; every request now has a deadline and
    close() cuts clients instead of waiting for them."""
    proxy = ProxyServer(request_deadline=1.0, max_poll_s=0.0)
    url = proxy.start()
    stop = threading.Event()
    t = threading.Thread(target=_dribble, args=(url, stop), daemon=True)
    t.start()
    t.join(6.0)  # the request deadline (1 s) cuts it long before it finishes (~12 s)
    assert not t.is_alive(), "the server did not cut a request past its deadline"
    connected = threading.Event()
    t2 = threading.Thread(target=_dribble, args=(url, stop, connected), daemon=True)
    t2.start()
    assert connected.wait(5.0)
    t0 = time.monotonic()
    proxy.close(timeout=5.0)
    assert time.monotonic() - t0 < 2.0
    t2.join(5.0)
    stop.set()
    assert not t2.is_alive()


def test_handlers_are_bounded_and_the_rest_get_503() -> None:
    with ProxyServer(max_handlers=2, max_poll_s=5.0) as proxy:
        held = [socket.create_connection(urllib.parse.urlsplit(proxy.url).netloc.rsplit(":", 1))
                for _ in range(2)]
        try:
            deadline = time.monotonic() + 5
            status = None
            while time.monotonic() < deadline:  # the two held connections are accepted
                try:
                    urllib.request.urlopen(f"{proxy.url}/v1/status/none", timeout=2)
                except urllib.error.HTTPError as exc:
                    status = exc.code
                    answer = (exc.reason, exc.headers.get("Connection"),
                              exc.headers.get("Content-Length"), exc.read())
                if status == 503:
                    break
            assert status == 503
            # a complete answer that tells the client not to reuse the connection
            assert answer == ("Service Unavailable", "close", "0", b"")
        finally:
            for s in held:
                s.close()


def test_an_authenticated_metaserver_refuses_requests_without_its_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SFA_RD2H_METASERVER_TOKEN", raising=False)
    with ProxyServer(auth_token="s3cret", max_poll_s=0.5) as proxy:
        assert post_rendezvous(proxy.metaserver_url, _rdv("r1"), retries=0) == 401
        with pytest.raises(ProxyRequestError) as exc:
            fetch_work(proxy.url, "decode", "d0", timeout=0.1)
        assert exc.value.status == 401
        assert post_rendezvous(proxy.metaserver_url, _rdv("r1"), retries=0,
                               token="wrong") == 401
        assert post_rendezvous(proxy.metaserver_url, _rdv("r1"), retries=0,
                               token="s3cret") != 401
        monkeypatch.setenv("SFA_RD2H_METASERVER_TOKEN", "s3cret")  # the clients' default
        assert fetch_work(proxy.url, "decode", "d0", timeout=0.1) == []


# --------------------------------------------------------------------------- test strength
# (issue 12) Behaviour a Decode or Prefill instance observes, each checked to fail against
# one planted bug.


@pytest.mark.parametrize(("port", "tp"), [(65534, 2), (65535, 1), (65500, 36), (2, 65534)])
def test_rendezvous_whose_last_rank_port_is_65535_is_accepted(port: int, tp: int) -> None:
    """P2: base + tp - 1 is the highest port a Decode rank binds; exactly 65535 is valid,
    over the HTTP endpoint too, and one more is refused."""
    obj = _rdv("req-1", remote_port=port, remote_tp_size=tp).to_json()
    assert Rendezvous.from_json(obj).remote_port == port
    with ProxyServer(max_poll_s=0.5) as proxy:
        proxy.submit("prompt", "d0", "p0", job_id="job")
        assert post_rendezvous(proxy.metaserver_url, _rdv("job-0", remote_port=port,
                                                          remote_tp_size=tp)) == 200
        [job] = fetch_work(proxy.url, "prefill", "p0", timeout=0)
        assert job["requests"][0]["kv_transfer_params"]["remote_port"] == port
    obj["remote_tp_size"] = tp + 1
    with pytest.raises(RendezvousError, match=r"exceeds 65535 \(P2\)"):
        Rendezvous.from_json(obj)


def test_a_long_poll_asking_for_longer_than_the_cap_returns_within_the_cap() -> None:
    """A client asking for timeout=9999 holds a handler thread for at most max_poll_s."""
    with ProxyServer(max_poll_s=0.5) as proxy:
        for role in ("decode", "prefill"):
            t0 = time.monotonic()
            status, body = _raw(proxy.url, "GET", f"/v1/{role}_work?instance=x&timeout=9999")
            assert (status, body) == (200, [])
            assert time.monotonic() - t0 < 5.0


class _PollWatch(ProxyServer):
    """A proxy that says when a long poll has started waiting: it enters ``_take`` holding
    the (re-entrant) lock, so whatever the test does next happens while the poll waits."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.polling = threading.Event()

    def _take(self, queues: Any, instance: str, timeout: float, decode: bool) -> Any:
        with self._cond:
            if not decode:
                self.polling.set()
            return super()._take(queues, instance, timeout, decode)


def test_a_waiting_prefill_poll_returns_as_soon_as_its_job_is_queued() -> None:
    """C3: the last rendezvous of a job queues it for Prefill, and the Prefill long poll
    already waiting returns at once, not at its timeout."""
    with _PollWatch(max_poll_s=30.0) as proxy:
        job_id = proxy.submit(["a", "b"], "d0", "p0")
        items = fetch_work(proxy.url, "decode", "d0", timeout=0)
        assert len(items) == 2
        assert post_rendezvous(proxy.metaserver_url, _rdv(items[0]["request_id"])) == 200
        got: list[Any] = []
        poll = threading.Thread(target=lambda: got.append(
            fetch_work(proxy.url, "prefill", "p0", timeout=20)))
        poll.start()
        assert proxy.polling.wait(WAIT)
        t0 = time.monotonic()
        assert post_rendezvous(proxy.metaserver_url, _rdv(items[1]["request_id"])) == 200
        poll.join(WAIT)
        elapsed = time.monotonic() - t0
        assert not poll.is_alive() and elapsed < 5.0, elapsed
        [[job]] = got
        assert job["job"] == job_id and len(job["requests"]) == 2


class _DecodePollWatch(ProxyServer):
    """Counts the Decode long polls that have started waiting (entered ``_take``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.waiting = threading.Semaphore(0)

    def _take(self, queues: Any, instance: str, timeout: float, decode: bool) -> Any:
        with self._cond:
            if decode:
                self.waiting.release()
            return super()._take(queues, instance, timeout, decode)


def test_work_taken_for_a_dead_long_poll_goes_to_the_next_poll() -> None:
    """A Decode rank crashed while its long poll waited (restart-decode): the work that
    arrives next must reach the restarted rank's poll, not the dead socket (issue 9)."""
    with _DecodePollWatch(max_poll_s=30.0) as proxy:
        host, port = proxy.url.split("//")[1].split(":")
        dead = socket.create_connection((host, int(port)))
        dead.sendall(b"GET /v1/decode_work?instance=d0&timeout=20 HTTP/1.1\r\n"
                     b"Host: x\r\n\r\n")
        assert proxy.waiting.acquire(timeout=10)  # the dead client's poll waits now
        dead.close()  # the crash: the kernel closes its socket, the poll still waits
        proxy.submit(["a", "b"], "d0", "p0", job_id="j")
        t0 = time.monotonic()
        items = fetch_work(proxy.url, "decode", "d0", timeout=10)
        assert [i["request_id"] for i in items] == ["j-0", "j-1"]
        assert time.monotonic() - t0 < 10  # given to this poll, not found at its timeout


class _RequeueWatch(ProxyServer):
    """Says when a long poll waits (either role) and when work went back to its queue."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.waiting = threading.Semaphore(0)
        self.requeued = threading.Event()

    def _take(self, queues: Any, instance: str, timeout: float, decode: bool) -> Any:
        with self._cond:
            self.waiting.release()
            return super()._take(queues, instance, timeout, decode)

    def _requeue(self, path: str, query: Any, items: Any) -> None:
        super()._requeue(path, query, items)
        self.requeued.set()


@pytest.mark.parametrize(("role", "reset"), [("decode", False), ("prefill", False),
                                           ("decode", True)])
def test_work_of_a_dead_poll_is_queued_again_for_its_own_role(role: str, reset: bool) -> None:
    """Work a dead long poll took goes back to the queue of that role and instance, and
    the job's status says it is waiting to be fetched again, not out with a poller. A
    client that died with a reset (RST, not FIN) is as dead."""
    with _RequeueWatch(max_poll_s=30.0) as proxy:
        job_id = proxy.submit(["a"], "d0", "p0", job_id="j")
        [item] = fetch_work(proxy.url, "decode", "d0", timeout=0)
        assert proxy.waiting.acquire(timeout=WAIT)
        host, port = proxy.url.split("//")[1].split(":")
        dead = socket.create_connection((host, int(port)))
        instance = "d1" if role == "decode" else "p0"
        dead.sendall(f"GET /v1/{role}_work?instance={instance}&timeout=20 HTTP/1.1\r\n"
                     "Host: x\r\n\r\n".encode())
        assert proxy.waiting.acquire(timeout=WAIT)  # the dead client's poll waits now
        if reset:
            dead.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        dead.close()
        if role == "decode":
            job_id = proxy.submit(["b"], "d1", "p1", job_id="k")
        else:  # the last rendezvous queues the job for Prefill
            assert post_rendezvous(proxy.metaserver_url, _rdv(item["request_id"])) == 200
        assert proxy.requeued.wait(WAIT)
        status = proxy.status(job_id)
        if role == "decode":
            assert status["requests"][0]["state"] == "queued"
            [item] = fetch_work(proxy.url, "decode", "d1", timeout=0)
            assert item["request_id"] == "k-0"
            assert proxy.status(job_id)["requests"][0]["state"] == "at_decode"
        else:
            assert status["prefill_fetched"] is False
            [job] = fetch_work(proxy.url, "prefill", "p0", timeout=0)
            assert job["job"] == "j" and proxy.status(job_id)["prefill_fetched"] is True


# --------------------------------------------------------------------------- /v1/finished


@pytest.mark.parametrize(("body", "status", "error"), [
    ([], 400, "body: expected a JSON object, got list"),
    ({"ok": True, "role": "decode"}, 400, "field 'request_id': expected a non-empty string"),
    ({"request_id": "", "ok": True, "role": "decode"}, 400,
     "field 'request_id': expected a non-empty string"),
    ({"request_id": 7, "ok": True, "role": "decode"}, 400,
     "field 'request_id': expected a non-empty string"),
    ({"request_id": "r", "role": "decode"}, 400, "field 'ok': expected a boolean"),
    ({"request_id": "r", "ok": True, "role": "x"}, 400,
     "field 'role': expected one of ['prefill', 'decode'], got 'x'"),
    ({"request_id": "r", "ok": True, "role": "decode", "error": 3}, 400,
     "field 'error': expected a string"),
    ({"request_id": "ghost", "ok": True, "role": "decode"}, 404, "unknown request_id 'ghost'"),
])
def test_finished_refuses_a_bad_report_naming_the_field(
        proxy: ProxyServer, body: object, status: int, error: str) -> None:
    assert _raw(proxy.url, "POST", "/v1/finished", json.dumps(body).encode()) == (
        status, {"error": error})


def test_finished_answers_first_and_repeated_reports(proxy: ProxyServer) -> None:
    """A report is acknowledged, a repeat with the same outcome says it was a duplicate,
    a contradicting one is refused; a long error text is kept up to 4096 characters.
    A base URL with a trailing slash works."""
    job_id = proxy.submit("hello", "d1", "p1", job_id="j")
    report = {"request_id": "j-0", "ok": False, "role": "decode", "error": "e" * 5000}
    post = json.dumps(report).encode()
    assert _raw(proxy.url, "POST", "/v1/finished", post) == (200, {"status": "ok"})
    assert _raw(proxy.url, "POST", "/v1/finished", post) == (
        200, {"status": "ok", "duplicate": True})
    flipped = json.dumps({**report, "ok": True}).encode()
    assert _raw(proxy.url, "POST", "/v1/finished", flipped) == (
        409, {"error": "request_id 'j-0': decode already reported ok=False"})
    assert proxy.status(job_id)["requests"][0]["errors"] == {"decode": "e" * 4096}
    report_finished(proxy.url + "/", "j-0", ok=False, role="decode")  # a duplicate, no error


def test_report_finished_gives_up_at_its_timeout() -> None:
    """A proxy that accepts but never answers: report_finished fails at its timeout
    (5 s unless given), it does not hang its worker."""
    assert inspect.signature(report_finished).parameters["timeout"].default == 5.0
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(OSError):
            report_finished(url, "r", ok=True, role="decode", timeout=0.2)


def test_wait_job_returns_a_job_that_finishes_while_it_waits(proxy: ProxyServer) -> None:
    """wait_job blocks until the job is done, however short its timeout, and returns its
    status; a job that does not finish in time is a TimeoutError, not a hang."""
    job_id = proxy.submit("hello", "d1", "p1", job_id="j")
    with pytest.raises(TimeoutError, match=r"job j not finished after 0.05s"):
        proxy.wait_job(job_id, 0.05)
    cond = proxy._cond
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> bool:
        # The waiter holds the (re-entrant) lock here: the report lands while it waits,
        # as one from a handler thread would, and wakes it.
        waits.append(timeout)
        assert proxy._post("/v1/finished", {"request_id": "j-0", "ok": False,
                                            "role": "decode"}) == (200, {"status": "ok"})
        return True

    cond.wait = wait  # type: ignore[method-assign]
    status = proxy.wait_job(job_id, 0.5)
    assert len(waits) == 1 and status["done"] is True and status["ok"] is False


# --------------------------------------------------------------------------- documents


def test_the_work_items_status_and_replies_are_the_documented_documents(
        proxy: ProxyServer) -> None:
    """What Decode, Prefill and a status reader get, field by field (C1, C3): a client
    written against these names must find them."""
    meta = proxy.metaserver_url
    job_id = proxy.submit(["ab", "cde"], "d0", "p0", job_id="j")
    items = fetch_work(proxy.url, "decode", "d0", timeout=0)
    assert items == [
        {"request_id": f"j-{i}", "job": "j", "index": i, "prompt": p, "num_tokens": len(p),
         "metaserver": meta,
         "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                "metaserver": meta}}
        for i, p in enumerate(["ab", "cde"])]
    first, second = _rdv("j-0"), _rdv("j-0", remote_port=31000)
    assert post_rendezvous(meta, first) == 200
    # before dispatch the latest rendezvous wins (a Decode that restarted), plainly
    status, reply = _raw(meta, "POST", "/v1/metaserver", json.dumps(second.to_json()).encode())
    assert (status, reply) == (200, {"status": "ok"})
    assert proxy.status(job_id) == {
        "job": "j", "done": False, "ok": False, "dispatched": False,
        "prefill_fetched": False, "decode_instance": "d0", "prefill_instance": "p0",
        "requests": [
            {"request_id": "j-0", "state": "rendezvous", "rendezvous": True,
             "prefill_ok": None, "decode_ok": None, "errors": {}},
            {"request_id": "j-1", "state": "at_decode", "rendezvous": False,
             "prefill_ok": None, "decode_ok": None, "errors": {}},
        ]}
    assert post_rendezvous(meta, _rdv("j-1")) == 200
    [job] = fetch_work(proxy.url, "prefill", "p0", timeout=0)
    assert job == {
        "job": "j", "prompts": ["ab", "cde"], "max_completion_tokens": 1, "min_tokens": 1,
        "requests": [
            {"request_id": "j-0", "prompt": "ab", "num_tokens": 2,
             "kv_transfer_params": second.to_json()},
            {"request_id": "j-1", "prompt": "cde", "num_tokens": 3,
             "kv_transfer_params": _rdv("j-1").to_json()},
        ]}
    # after dispatch: the same one again is a duplicate, another is refused
    assert _raw(meta, "POST", "/v1/metaserver", json.dumps(second.to_json()).encode()) == (
        200, {"status": "ok", "duplicate": True})
    assert _raw(meta, "POST", "/v1/metaserver", json.dumps(first.to_json()).encode()) == (
        409, {"error": "request_id 'j-0': a different rendezvous was already dispatched to "
                       "Prefill"})
    report_finished(proxy.url, "j-0", ok=True, role="prefill")
    report_finished(proxy.url, "j-0", ok=False, role="decode", error="x")
    sub = proxy.status(job_id)["requests"][0]
    assert (sub["prefill_ok"], sub["decode_ok"], sub["state"]) == (True, False, "failed")
    assert proxy.status(job_id)["prefill_fetched"] is True


def test_submit_refuses_what_it_cannot_queue(proxy: ProxyServer) -> None:
    longest = "j" * (MAX_ID_LEN - 12)
    assert proxy.submit("a", "d0", "p0", job_id=longest) == longest
    bad_id = f"job_id must be a non-empty string of at most {MAX_ID_LEN - 12} characters"
    for job_id in (longest + "j", "", 7):
        with pytest.raises(ValueError) as info:
            proxy.submit("a", "d0", "p0", job_id=job_id)  # type: ignore[arg-type]
        assert str(info.value) == bad_id
    with pytest.raises(ValueError) as info:
        proxy.submit([], "d0", "p0")
    assert str(info.value) == "prompts must not be empty"
    for decode, prefill, name in (("", "p0", "decode_instance"), ("d0", 5, "prefill_instance")):
        with pytest.raises(ValueError) as info:
            proxy.submit("a", decode, prefill)  # type: ignore[arg-type]
        assert str(info.value) == f"{name} must be a non-empty string"
    proxy.close()
    with pytest.raises(RuntimeError) as info:
        proxy.submit("a", "d0", "p0")
    assert str(info.value) == "ProxyServer is closed"


def test_client_errors_carry_the_url_and_the_cause() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1/metaserver"  # nobody listens
    with pytest.raises(MetaserverUnreachable) as info:
        post_rendezvous(url, _rdv("r-0"), retries=0, sleep=lambda _: None)
    err = info.value
    assert (err.url, err.attempts) == (url, 1)
    assert isinstance(err.last_error, urllib.error.URLError)
    assert str(err).startswith(f"metaserver {url} unreachable after 1 attempt(s) (F1): "
                               "URLError: ")
    with ProxyServer() as proxy:
        with pytest.raises(ProxyRequestError) as info2:
            report_finished(proxy.url, "ghost", ok=True, role="decode")
    assert info2.value.url == f"{proxy.url}/v1/finished" and info2.value.status == 404


def test_report_finished_posts_to_the_finished_path_of_the_base_url() -> None:
    """The request line itself (http.server would fold a doubled slash before a handler
    saw it), for a base URL with and without trailing slashes."""
    lines: list[bytes] = []

    def serve(listener: socket.socket, n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                lines.append(data.split(b"\r\n", 1)[0])
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(WAIT)
        t = threading.Thread(target=serve, args=(listener, 4))
        t.start()
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        for url in (base, base + "/", base + "//", base + "/pX/"):
            report_finished(url, "r", ok=True, role="decode")
        t.join(WAIT)
    assert lines == [b"POST /v1/finished HTTP/1.1"] * 3 + [b"POST /pX/v1/finished HTTP/1.1"]


# --------------------------------------------------------------------------- clients, raw


class _OneShotServer:
    """Answers each connection with ``reply`` (raw HTTP) and keeps what was asked: the
    request line, the headers and the body, exactly as the client sent them."""

    def __init__(self, reply: bytes, n: int = 1) -> None:
        self.reply = reply
        self.requests: list[bytes] = []
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.listener.settimeout(WAIT)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, args=(n,))
        self.thread.start()

    def _serve(self, n: int) -> None:
        for _ in range(n):
            conn, _ = self.listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                head, _, body = data.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: (\d+)", head)
                while length and len(body) < int(length.group(1)):
                    body += conn.recv(4096)
                self.requests.append(data[:len(head) + 4] + body)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.thread.join(WAIT)
        self.listener.close()


def test_fetch_work_asks_with_a_bare_get_and_refuses_what_is_not_a_list() -> None:
    server = _OneShotServer(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    try:
        with pytest.raises(ProxyRequestError) as info:
            fetch_work(server.url + "/X/", "prefill", "p 0", timeout=0.5)
    finally:
        server.close()
    url = f"{server.url}/X/v1/prefill_work?instance=p+0&timeout=0.5"
    assert (info.value.url, info.value.status) == (url, 200)
    assert str(info.value) == f"{url}: HTTP 200: expected a JSON list, got dict"
    [request] = server.requests
    assert request.startswith(b"GET /X/v1/prefill_work?instance=p+0&timeout=0.5 HTTP/1.1\r\n")
    assert b"content-length" not in request.lower()
    with pytest.raises(ValueError) as info2:
        fetch_work(server.url, "judge", "x")
    assert str(info2.value) == "role must be one of ('prefill', 'decode'), got 'judge'"


def test_fetch_work_gives_up_at_its_wait_plus_the_response_slack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metaserver, "RESPONSE_SLACK_S", 0.1)
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with pytest.raises(OSError):
            fetch_work(f"http://127.0.0.1:{listener.getsockname()[1]}", "decode", "d",
                       timeout=0.1)


@pytest.mark.parametrize("status", [b"200 OK", b"503 Busy"])
def test_an_answer_cut_off_mid_body_is_a_connection_error(status: bytes) -> None:
    """A proxy that closes while answering (its close() cuts long polls) leaves a body
    shorter than its Content-Length: the client raises ConnectionError, an OSError its
    callers already handle, not http.client.IncompleteRead, which nothing catches."""
    server = _OneShotServer(b"HTTP/1.0 %s\r\nContent-Length: 40\r\n\r\n[{\"job" % status)
    try:
        with pytest.raises(ConnectionError) as info:
            fetch_work(server.url, "decode", "d", timeout=0.1)
    finally:
        server.close()
    assert str(info.value).startswith(f"{server.url}/v1/decode_work?instance=d&timeout=0.1: "
                                      "answer cut off: IncompleteRead(")
    assert isinstance(info.value.__cause__, http.client.IncompleteRead)


@pytest.mark.parametrize(("reply", "message"), [
    (b'{"error": "no such job"}', "no such job"),
    (b"\xff" + b"x" * 300, "\ufffd" + "x" * 199),  # not JSON: its first 200 bytes, as text
])
def test_an_error_answer_names_the_url_status_and_message(reply: bytes, message: str) -> None:
    server = _OneShotServer(b"HTTP/1.0 503 Busy\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(reply), reply))
    try:
        with pytest.raises(ProxyRequestError) as info:
            report_finished(server.url, "r", ok=True, role="decode", error="e")
    finally:
        server.close()
    url = f"{server.url}/v1/finished"
    assert (info.value.url, info.value.status) == (url, 503)
    assert str(info.value) == f"{url}: HTTP 503: {message}"
    [request] = server.requests
    assert request.startswith(b"POST /v1/finished HTTP/1.1\r\n")
    assert json.loads(request.partition(b"\r\n\r\n")[2]) == {
        "request_id": "r", "ok": True, "role": "decode", "error": "e"}


def test_post_rendezvous_defaults_arguments_and_logging(
        caplog: pytest.LogCaptureFixture) -> None:
    """F1 defaults: 6 attempts (5 retries) 0.05 s apart, doubling; every failed attempt
    and an error answer are logged with the URL."""
    url = f"http://127.0.0.1:{free_port()}/v1/metaserver"
    delays: list[float] = []
    caplog.set_level(logging.INFO, logger=metaserver.__name__)
    with pytest.raises(MetaserverUnreachable):
        post_rendezvous(url, _rdv("r-0"), sleep=delays.append)
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8]
    failed = [r.getMessage() for r in caplog.records]
    assert len(failed) == 6 and failed[0].startswith(f"metaserver {url} attempt 1 failed: ")
    assert failed[5].startswith(f"metaserver {url} attempt 6 failed: <urlopen error")
    for kw, ok in (({"backoff": 0}, True), ({"backoff": -0.1}, False),
                   ({"retries": -1}, False), ({"timeout": 0}, False)):
        if ok:
            with pytest.raises(MetaserverUnreachable):
                post_rendezvous(url, _rdv("r-0"), retries=0, **kw)
        else:
            with pytest.raises(ValueError) as info:
                post_rendezvous(url, _rdv("r-0"), **kw)
            assert str(info.value) == "retries and backoff must be >= 0 and timeout > 0"
    with pytest.raises(TypeError) as info2:
        post_rendezvous(url, _rdv("r-0").to_json())  # type: ignore[arg-type]
    assert str(info2.value) == "expected a Rendezvous, got dict"
    caplog.clear()
    with ProxyServer() as proxy:
        assert post_rendezvous(proxy.metaserver_url, _rdv("ghost-0")) == 404
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"metaserver {proxy.metaserver_url} answered 404 for ghost-0"]


@pytest.mark.parametrize(("length", "body", "status", "error"), [
    (None, b"", 411, "Content-Length is required"),
    ("abc", b"", 400, "bad Content-Length 'abc'"),
    ("-1", b"", 400, "bad Content-Length '-1'"),
    ("0", b"", 400, "body is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("10", b"[1, 2]", 400, "body truncated: 6 of 10 bytes"),
    ("65", b" " * 65, 413, "body of 65 bytes exceeds the limit of 64"),
    ("64", b"[" + b" " * 62 + b"]", 400, "body: expected a JSON object, got list"),
])
def test_a_body_is_read_by_its_content_length_up_to_the_limit(
        length: str | None, body: bytes, status: int, error: str) -> None:
    with ProxyServer(max_body=64) as proxy:
        host, port = proxy.url.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=WAIT) as s:
            head = b"" if length is None else b"Content-Length: %s\r\n" % length.encode()
            s.sendall(b"POST /v1/finished HTTP/1.1\r\nHost: x\r\n%s\r\n%s" % (head, body))
            s.shutdown(socket.SHUT_WR)  # a truncated body ends here
            resp = http.client.HTTPResponse(s)
            resp.begin()
            assert (resp.status, json.loads(resp.read())) == (status, {"error": error})
        assert _raw(proxy.url, "POST", "/v1/nowhere", b"{}") == (
            404, {"error": "no such endpoint: POST /v1/nowhere"})


def test_a_cut_client_is_a_debug_line_and_a_handler_bug_an_error(
        proxy: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    """socketserver's handle_error hook: a client cut by its deadline or by close() (the
    handler's write fails with an OSError) is logged at debug level with its traceback;
    anything else is a logged error."""
    caplog.set_level(logging.DEBUG, logger=metaserver.__name__)
    for exc in (BrokenPipeError("cut"), KeyError("bug")):
        try:
            raise exc
        except Exception:  # noqa: BLE001 - handle_error reads the exception being handled
            proxy._server.handle_error(None, ("127.0.0.9", 4242))
    cut, bug = caplog.records
    assert (cut.levelno, cut.getMessage()) == (
        logging.DEBUG, "metaserver: client ('127.0.0.9', 4242) cut")
    assert cut.exc_info is not None and cut.exc_info[0] is BrokenPipeError
    assert (bug.levelno, bug.getMessage()) == (
        logging.ERROR, "metaserver: handler for ('127.0.0.9', 4242) failed")


def _refusal(**changes: object) -> str:
    obj = _rdv("req-1").to_json()
    for key, value in changes.items():
        if value is _ABSENT:
            obj.pop(key, None)
        else:
            obj[key] = value
    with pytest.raises(RendezvousError) as info:
        Rendezvous.from_json(obj)
    return str(info.value)


_ABSENT = object()


@pytest.mark.parametrize(("changes", "message"), [
    ({"request_id": 5}, "'request_id': expected a string, got int"),
    ({"request_id": "r" * (MAX_ID_LEN + 1)},
     f"'request_id': length {MAX_ID_LEN + 1} is outside 1..{MAX_ID_LEN}"),
    ({"remote_host": "a b"}, "'remote_host': 'a b' contains whitespace"),
    ({"remote_host": "0.0.0.0"}, "'remote_host': '0.0.0.0' is a wildcard, not a reachable host"),
    ({"remote_port": "1"}, "'remote_port': expected an integer, got str"),
    ({"remote_port": 0}, "'remote_port': 0 is outside 1..65535"),
    ({"remote_port": 65536, "remote_tp_size": 1}, "'remote_port': 65536 is outside 1..65535"),
    ({"remote_port": 1, "remote_tp_size": 65536}, "'remote_tp_size': 65536 is outside 1..65535"),
    ({"remote_port": 65000, "remote_tp_size": 600},
     "'remote_port': base port 65000 + tp 600 - 1 = 65599 exceeds 65535 (P2)"),
    ({"remote_pcp_size": 2}, "'remote_pcp_size': 2 is outside 1..1"),
    ({"remote_dcp_size": 2}, "'remote_dcp_size': 2 is outside 1..1"),
    ({"remote_cached_tokens": 2**63}, f"'remote_cached_tokens': {2**63} is outside "
                                      f"0..{2**63 - 1}"),
    ({"do_remote_prefill": True},
     "'do_remote_prefill': must be false in a rendezvous (C1: Decode clears it)"),
    ({"do_remote_decode": False},
     "'do_remote_decode': must be true in a rendezvous (Prefill must push to Decode)"),
    ({"do_remote_decode": 1}, "'do_remote_decode': expected a boolean, got int"),
])
def test_a_refused_rendezvous_names_the_field_and_the_reason(changes: dict,
                                                             message: str) -> None:
    assert _refusal(**changes) == f"rendezvous field {message}"


def test_a_rendezvous_at_its_limits_is_accepted_and_optional_fields_default() -> None:
    obj = _rdv("r" * MAX_ID_LEN).to_json()
    obj.update(remote_port=1, remote_tp_size=1, remote_cached_tokens=2**63 - 1)
    for key in ("remote_pcp_size", "remote_dcp_size", "do_remote_prefill", "do_remote_decode"):
        obj.pop(key, None)
    rdv = Rendezvous.from_json(obj)
    assert (rdv.request_id, rdv.remote_port, rdv.remote_cached_tokens) == (
        "r" * MAX_ID_LEN, 1, 2**63 - 1)
    assert (rdv.remote_pcp_size, rdv.remote_dcp_size) == (1, 1)
    assert (rdv.do_remote_prefill, rdv.do_remote_decode) == (False, True)
    with pytest.raises(RendezvousError) as info:
        Rendezvous.from_json([obj])
    assert str(info.value) == "rendezvous field '<body>': expected a JSON object, got list"


def test_a_long_poll_waits_only_when_asked_to(proxy: ProxyServer) -> None:
    """Without a timeout a poll answers at once; with one (under a second too) it waits,
    and work queued while it waits is its answer. Bad query parameters are 400s."""
    cond = proxy._cond
    waits: list[float | None] = []

    def wait(timeout: float | None = None) -> bool:
        # The poll holds the (re-entrant) lock here: work submitted now is queued while
        # it waits, as a submit from another thread would be, and wakes it.
        waits.append(timeout)
        proxy.submit("a", "d0", "p0", job_id=f"j{len(waits)}")
        return True

    cond.wait = wait  # type: ignore[method-assign]
    assert _raw(proxy.url, "GET", "/v1/decode_work?instance=d9") == (200, [])
    assert waits == []
    status, items = _raw(proxy.url, "GET", "/v1/decode_work?instance=d0&timeout=0.5")
    assert status == 200 and [i["request_id"] for i in items] == ["j1-0"] and len(waits) == 1
    assert _raw(proxy.url, "GET", "/v1/decode_work?timeout=0") == (
        400, {"error": "query parameter 'instance' is required"})
    assert _raw(proxy.url, "GET", "/v1/status?job=nope") == (404, {"error": "unknown job 'nope'"})
    assert _raw(proxy.url, "GET", "/v1/decode_work?instance=d0&timeout=-1") == (
        400, {"error": "query parameter 'timeout': -1.0 is not a finite number >= 0"})


def test_client_requests_are_labelled_json_and_carry_the_token_only_when_one_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the metaserver (or a proxy in front of it) receives from each client: a JSON
    content type, and the bearer token from the argument or the environment, none when
    neither sets one (an empty token is no token)."""
    monkeypatch.delenv("SFA_RD2H_METASERVER_TOKEN", raising=False)
    server = _OneShotServer(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n[]", n=5)
    try:
        post_rendezvous(server.url + "/v1/metaserver", _rdv("r-0"), retries=0)
        post_rendezvous(server.url + "/v1/metaserver", _rdv("r-0"), retries=0, token="")
        post_rendezvous(server.url + "/v1/metaserver", _rdv("r-0"), retries=0, token="t0k")
        monkeypatch.setenv("SFA_RD2H_METASERVER_TOKEN", "env-t0k")
        fetch_work(server.url, "decode", "d0", timeout=0.1)
        report_finished(server.url, "r-0", ok=True, role="decode")
    finally:
        server.close()

    def headers(request: bytes) -> dict[str, str]:
        lines = request.partition(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
        return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}

    got = [headers(r) for r in server.requests]
    assert [h.get("content-type") for h in got] == ["application/json"] * 5
    assert [h.get("authorization") for h in got] == [
        None, None, "Bearer t0k", "Bearer env-t0k", "Bearer env-t0k"]


def test_each_request_is_a_debug_line_naming_the_client(
        proxy: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    """http.server's access log goes to the module's logger at debug level (not stderr),
    led by the client's address."""
    caplog.set_level(logging.DEBUG, logger=metaserver.__name__)
    assert _raw(proxy.url, "GET", "/v1/health") == (200, {"status": "ok"})
    lines = [r.getMessage() for r in caplog.records
             if r.levelno == logging.DEBUG and "/v1/health" in r.getMessage()]
    assert lines == ['127.0.0.1 "GET /v1/health HTTP/1.1" 200 -']


def test_clients_take_http_and_https_urls_with_a_host_only() -> None:
    port = free_port()
    for url in (f"https://127.0.0.1:{port}/v1/metaserver", f"http://127.0.0.1:{port}/x"):
        with pytest.raises(MetaserverUnreachable):  # accepted, then nothing listens
            post_rendezvous(url, _rdv("r-0"), retries=0)
    for url in ("http:///v1/metaserver", "ftp://127.0.0.1/v1/metaserver", "127.0.0.1:80"):
        with pytest.raises(ValueError) as info:
            post_rendezvous(url, _rdv("r-0"), retries=0)
        assert str(info.value) == f"expected an http(s) URL, got {url!r}"


class _ServingThreadStandIn:
    """Stands in for the proxy's serving thread in close(): records how long close() lets
    it take to end, and ends within that time or never (``ends``)."""

    def __init__(self, ends: bool) -> None:
        self.ends = ends
        self.alive = True
        self.join_timeouts: list[float | None] = []

    def join(self, timeout: float | None = None) -> None:
        self.join_timeouts.append(timeout)
        if self.ends and (timeout is None or timeout > 0):
            self.alive = False

    def is_alive(self) -> bool:
        return self.alive


@pytest.mark.parametrize("ends", [True, False])
def test_close_waits_for_the_serving_thread_within_its_timeout_and_reports_one_that_stays(
        ends: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=metaserver.__name__)
    proxy = ProxyServer()
    proxy.start()
    real = proxy._thread
    assert real is not None
    stand_in = _ServingThreadStandIn(ends)
    proxy._thread = stand_in  # type: ignore[assignment]
    proxy.close(timeout=0.5)
    real.join(WAIT)  # close() stopped the real one (server.shutdown waits for it)
    assert not real.is_alive()
    [waited] = stand_in.join_timeouts
    assert waited is not None and 0 < waited <= 0.5
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ([] if ends else ["metaserver: serving thread still alive 0.5s after close"])


@pytest.mark.parametrize(("advertise", "shown"), [
    (None, "127.0.0.1"), ("10.0.0.5", "10.0.0.5"), ("fd00::5", "[fd00::5]")])
def test_the_url_names_the_advertised_host_and_the_bound_port(
        advertise: str | None, shown: str) -> None:
    """What Decode and Prefill are told to use: the advertised host (an IPv6 address in
    brackets) or the bound one, with the port actually bound; a proxy serves once."""
    proxy = ProxyServer(advertise_host=advertise)
    with pytest.raises(RuntimeError) as info:
        proxy.url  # noqa: B018 - the property raises before start()
    assert str(info.value) == "ProxyServer is not started"
    try:
        url = proxy.start()
        port = proxy._server.server_address[1]
        assert (url, proxy.url) == (f"http://{shown}:{port}",) * 2
        assert proxy.metaserver_url == f"http://{shown}:{port}/v1/metaserver"
        if advertise is None:
            assert _raw(url, "GET", "/v1/health") == (200, {"status": "ok"})
        with pytest.raises(RuntimeError) as again:
            proxy.start()
        assert str(again.value) == "ProxyServer can be started once"
    finally:
        proxy.close()
    with pytest.raises(RuntimeError, match="can be started once"):
        proxy.start()


def test_the_serving_thread_is_a_named_daemon(proxy: ProxyServer) -> None:
    """A proxy left unclosed never keeps the process alive, and thread dumps and leak checks
    can tell its thread by name."""
    [serving] = [t for t in threading.enumerate() if t is proxy._thread]
    assert (serving.name, serving.daemon, serving.is_alive()) == ("metaserver-http", True, True)


def test_proxy_settings_out_of_range_are_refused_and_their_limits_accepted() -> None:
    message = "max_body, max_handlers and request_deadline must be > 0 and max_poll_s >= 0"
    for bad in ({"max_body": 0}, {"max_poll_s": -0.001}, {"max_handlers": 0},
                {"request_deadline": 0}):
        with pytest.raises(ValueError) as info:
            ProxyServer(**bad)  # type: ignore[arg-type]
        assert str(info.value) == message, bad
    edge = ProxyServer(max_body=1, max_poll_s=0.0, max_handlers=1, request_deadline=0.5)
    assert (edge.max_body, edge.max_poll_s, edge.max_handlers, edge.request_deadline) == (
        1, 0.0, 1, 0.5)


def test_an_advertise_host_that_is_not_a_string_is_refused_before_binding() -> None:
    with pytest.raises(ValueError) as info:
        ProxyServer(advertise_host=b"10.0.0.1")  # type: ignore[arg-type]
    assert str(info.value) == "advertise_host must be a host name (str), got bytes"


def test_a_start_that_fails_after_binding_releases_the_port_and_close_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving thread cannot start (the process is out of threads): start() raises,
    the port it bound is free again, and close() returns instead of waiting in shutdown()
    for a serve_forever that never ran."""
    port = free_port()
    proxy = ProxyServer(port=port)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        proxy.start()
    monkeypatch.undo()
    closer = threading.Thread(target=proxy.close)
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # released: a second bind succeeds
    with pytest.raises(RuntimeError, match="ProxyServer is not started"):
        _ = proxy.url


def test_proxies_with_default_settings_run_side_by_side_and_take_the_token_from_the_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each binds a free loopback port of its own; the bearer token defaults to
    SFA_RD2H_METASERVER_TOKEN, and an explicit empty token turns authentication off."""
    monkeypatch.setenv("SFA_RD2H_METASERVER_TOKEN", "env-t0k")
    with ProxyServer() as guarded, ProxyServer(auth_token="") as open_:
        assert guarded.url != open_.url
        assert all(u.startswith("http://127.0.0.1:") for u in (guarded.url, open_.url))
        assert _raw(guarded.url, "GET", "/v1/health")[0] == 401
        assert _raw(guarded.url, "GET", "/v1/health",
                    headers={"Authorization": "Bearer env-t0k"})[0] == 200
        assert _raw(open_.url, "GET", "/v1/health") == (200, {"status": "ok"})


# --------------------------------------------------------------------------- replies


@pytest.mark.parametrize(("method", "path", "body", "status", "payload"), [
    ("GET", "/v1/health", None, 200, {"status": "ok"}),
    ("GET", "/v1/nothing?job=j", None, 404, {"error": "no such endpoint: GET /v1/nothing"}),
    ("POST", "/v1/finished", b"[]", 400, {"error": "body: expected a JSON object, got list"}),
])
def test_every_reply_is_json_labelled_with_its_exact_length(
        proxy: ProxyServer, method: str, path: str, body: bytes | None, status: int,
        payload: Any) -> None:
    """A client learns what it got from the headers: the body is JSON and its length is
    known before it is read (so a short read is a truncated answer, not the end of one).
    An unknown path is named without its query string."""
    got, headers, raw = _response(proxy.url, method, path, body)
    assert (got, json.loads(raw)) == (status, payload)
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Length"] == str(len(raw))


def test_a_blank_timeout_is_refused_not_taken_as_no_wait(proxy: ProxyServer) -> None:
    """``timeout=`` is a bad value, answered 400 like any other; it does not fall back to
    the default of answering at once, and the refused poll takes no work."""
    proxy.submit("a", "d0", "p0", job_id="j")
    for role, instance in (("decode", "d0"), ("prefill", "p0")):
        assert _raw(proxy.url, "GET", f"/v1/{role}_work?instance={instance}&timeout=") == (
            400, {"error": "query parameter 'timeout': not a number: ''"})
    assert [i["request_id"] for i in fetch_work(proxy.url, "decode", "d0", timeout=0)] == [
        "j-0"]


def test_a_refused_request_gets_401_and_nothing_after_it_on_its_connection_is_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the token a request is answered 401 with what to send, and its connection
    is closed: neither its body, left unread, nor a request pipelined after it is taken
    as a request of its own."""
    monkeypatch.delenv("SFA_RD2H_METASERVER_TOKEN", raising=False)
    refusal = {"error": "a valid 'Authorization: Bearer <token>' is required"}
    with ProxyServer(auth_token="s3cret") as proxy:
        assert _raw(proxy.url, "GET", "/v1/health",
                    headers={"Authorization": "Bearer wrong"}) == (401, refusal)
        body = json.dumps(_rdv("r-0").to_json()).encode()
        answer = _exchange(proxy.url, b"POST /v1/metaserver HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body) + _HEALTH)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 401 ")
    assert rest == json.dumps(refusal).encode()  # one answer, and nothing after it


def test_a_long_poll_waiting_when_the_proxy_closes_is_answered_503(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close() wakes a waiting long poll, which answers 503 with the reason, so a Decode
    or Prefill rank can tell a proxy going away from a lost connection. (close() cuts its
    clients right after waking them; here the cut waits for the answer to be read, so the
    answer is what is checked, not who wins that race.)"""
    proxy = _DecodePollWatch(max_poll_s=30.0)
    proxy.start()
    server = proxy._server
    assert server is not None
    answered = threading.Event()
    cut = server.abort_clients

    def cut_once_answered() -> None:
        answered.wait(WAIT)
        cut()

    monkeypatch.setattr(server, "abort_clients", cut_once_answered)
    parts = urllib.parse.urlsplit(proxy.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT)
    closer = threading.Thread(target=proxy.close)
    try:
        conn.request("GET", "/v1/decode_work?instance=d0&timeout=20")
        assert proxy.waiting.acquire(timeout=WAIT)  # the poll waits now
        closer.start()
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (
            503, {"error": "metaserver is shutting down"})
    finally:
        answered.set()
        conn.close()
        if closer.ident is not None:
            closer.join(WAIT)
        proxy.close()
    assert not closer.is_alive()


# --------------------------------------------------------------------------- connections


def _connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=WAIT)


def _until_eof(s: socket.socket) -> bytes:
    """Everything the proxy sends on a connection until it closes it. A reset after the
    close (the proxy left bytes of ours unread) ends it too; what came before is kept."""
    answer = b""
    try:
        while chunk := s.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def _exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes on a connection of its own; return all the proxy answers on it."""
    with _connect(url) as s:
        s.sendall(request)
        return _until_eof(s)


_HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Records(logging.Handler):
    """Keeps the metaserver's log records as they are written; ``arrived`` is set by the
    first at ``level`` or above, so a test can await a line a handler thread writes."""

    def __init__(self, level: int) -> None:
        super().__init__(logging.DEBUG)
        self.level_awaited = level
        self.records: list[logging.LogRecord] = []
        self.arrived = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if record.levelno >= self.level_awaited:
            self.arrived.set()


def test_exactly_max_handlers_clients_are_served_at_once_and_a_freed_slot_is_served_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """With ``max_handlers`` clients being served, the next is answered 503 at once and its
    connection closed; as soon as one of them is answered, its slot serves new clients
    again, one after the other. Refusing a client is no error worth a log line."""
    caplog.set_level(logging.WARNING, logger=metaserver.__name__)
    with _DecodePollWatch(max_handlers=2, max_poll_s=30.0) as proxy:
        polls = [_connect(proxy.url) for _ in range(2)]
        try:
            for i, s in enumerate(polls):
                s.sendall(b"GET /v1/decode_work?instance=d%d&timeout=20 HTTP/1.1\r\n"
                          b"Host: x\r\n\r\n" % i)
                assert proxy.waiting.acquire(timeout=WAIT)  # being served: its poll waits
            assert _exchange(proxy.url, _HEALTH) == _BUSY
            proxy.submit("a", "d0", "p0", job_id="j")  # answers the first poll
            head, _, body = _until_eof(polls[0]).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200 OK\r\n")
            assert [item["request_id"] for item in json.loads(body)] == ["j-0"]
            for _ in range(3):  # one slot is free again, and again once each is answered
                head, _, body = _exchange(proxy.url, _HEALTH).partition(b"\r\n\r\n")
                assert (head.split(b"\r\n")[0], body) == (b"HTTP/1.0 200 OK",
                                                          b'{"status": "ok"}')
            assert [r.getMessage() for r in caplog.records] == []
        finally:
            for s in polls:
                s.close()


def test_a_client_that_connects_while_close_runs_is_cut_not_served(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Once close() has cut the clients, the server may still accept one more before it
    stops: that one is closed unanswered (no later sweep would cut it), quietly."""
    caplog.set_level(logging.WARNING, logger=metaserver.__name__)
    proxy = ProxyServer()
    proxy.start()
    server = proxy._server
    assert server is not None
    cut, release = threading.Event(), threading.Event()
    stop = server.shutdown

    def stop_once_released() -> None:  # close() runs this right after cutting the clients
        cut.set()
        release.wait(WAIT)
        stop()

    monkeypatch.setattr(server, "shutdown", stop_once_released)
    closer = threading.Thread(target=proxy.close)
    closer.start()
    try:
        assert cut.wait(WAIT)  # the clients are cut; the server still accepts
        assert _exchange(proxy.url, _HEALTH) == b""
    finally:
        release.set()
        closer.join(WAIT)
    assert not closer.is_alive()
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_handler_bug_costs_its_request_a_500_naming_it_and_one_logged_traceback(
        proxy: ProxyServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        method: str) -> None:
    """A bug in serving one request answers that request 500 with the exception's type and
    text, and logs one error with its traceback naming the method and the path (query
    included); the proxy goes on serving."""
    caplog.set_level(logging.INFO, logger=metaserver.__name__)

    def bug(*args: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(proxy, "_get" if method == "GET" else "_post", bug)
    path = "/v1/health?probe=1" if method == "GET" else "/v1/finished?probe=1"
    assert _raw(proxy.url, method, path, None if method == "GET" else b"{}") == (
        500, {"error": "internal error: ValueError: boom"})
    [record] = caplog.records
    assert (record.levelno, record.getMessage()) == (
        logging.ERROR, f"metaserver: internal error on {method} {path}")
    assert record.exc_info is not None and record.exc_info[0] is ValueError
    if method == "POST":
        assert _raw(proxy.url, "GET", "/v1/health") == (200, {"status": "ok"})
    else:
        assert _raw(proxy.url, "POST", "/v1/nowhere", b"{}") == (
            404, {"error": "no such endpoint: POST /v1/nowhere"})


def test_a_client_that_stalls_mid_body_is_dropped_with_one_info_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A client that stops sending halfway through its body is dropped once its socket
    read times out: its connection is closed unanswered, and the only log line is one
    info naming the client and why; nothing more is read from it."""
    monkeypatch.setattr(metaserver._Handler, "timeout", 0.2)
    caplog.set_level(logging.DEBUG, logger=metaserver.__name__)
    with ProxyServer() as proxy:
        assert _exchange(proxy.url, b"POST /v1/finished HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Length: 10\r\n\r\n{\"a") == b""
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.INFO, "metaserver: client 127.0.0.1 dropped: timed out")]


def test_an_answer_whose_client_reset_the_connection_is_an_info_line() -> None:
    """A long poll whose client reset its connection while it waited answers into the
    reset: the answer is lost, which is one info line naming the client and the error."""
    records = _Records(logging.INFO)
    logger = logging.getLogger(metaserver.__name__)
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with _DecodePollWatch(max_poll_s=30.0) as proxy:
            with _connect(proxy.url) as s:
                s.sendall(b"GET /v1/decode_work?instance=d0&timeout=0.5 HTTP/1.1\r\n"
                          b"Host: x\r\n\r\n")
                assert proxy.waiting.acquire(timeout=WAIT)  # the poll waits now
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            assert records.arrived.wait(WAIT)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    lost = [(r.levelno, r.getMessage()) for r in records.records if r.levelno >= logging.INFO]
    assert lost in [[(logging.INFO, f"metaserver: reply to 127.0.0.1 lost: [Errno {e}] "
                                    f"{os.strerror(e)}")] for e in (ECONNRESET, EPIPE)]


@pytest.mark.parametrize(("request_line", "status_line", "content_type"), [
    (b"GET /v1/health\r\n\r\n", b"HTTP/1.0 200 OK", b"application/json"),
    (b"POST /v1/finished\r\n", b"HTTP/1.0 400 Bad HTTP/0.9 request type ('POST')",
     b"text/html;charset=utf-8"),
    (b"GARBAGE\r\n", b"HTTP/1.0 400 Bad request syntax ('GARBAGE')",
     b"text/html;charset=utf-8"),
    (b"GET /v1/health HTTP/2.0\r\n", b"HTTP/1.0 505 Invalid HTTP version (2.0)",
     b"text/html;charset=utf-8"),
])
def test_a_request_without_an_http_1_version_gets_a_whole_http_1_0_answer(
        proxy: ProxyServer, request_line: bytes, status_line: bytes,
        content_type: bytes) -> None:
    """http.server answers a request line with no version (HTTP/0.9) or one it cannot
    parse with a bare body, no status line: a client could not tell an error from a
    hang-up. The proxy answers it in HTTP/1.0, the status line giving the reason, with a
    body of the length it announces, and closes the connection."""
    head, _, body = _exchange(proxy.url, request_line).partition(b"\r\n\r\n")
    first, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    assert first == status_line
    assert (headers[b"Content-Type"], headers[b"Content-Length"]) == (
        content_type, str(len(body)).encode())
    if content_type == b"application/json":
        assert json.loads(body) == {"status": "ok"}
    else:
        assert headers[b"Connection"] == b"close"


def test_a_client_refused_as_busy_gets_its_whole_503_even_if_close_cuts_the_clients_then(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close() cuts the clients being served; one refused as busy is not among them. Here
    the cut comes at the worst moment, just as the serving thread writes the refusal: the
    client being served is cut, the refused one still gets its whole 503."""
    with _DecodePollWatch(max_handlers=1, max_poll_s=30.0) as proxy:
        server, serving = proxy._server, proxy._thread
        assert server is not None and serving is not None
        accept = server.get_request

        class _CutOnRefusal(socket.socket):
            def sendall(self, data: Any, flags: int = 0) -> None:
                if threading.current_thread() is serving:  # only a refusal is written there
                    server.abort_clients()
                super().sendall(data, flags)

        def get_request() -> tuple[socket.socket, Any]:
            sock, addr = accept()
            return _CutOnRefusal(sock.family, sock.type, sock.proto, sock.detach()), addr

        monkeypatch.setattr(server, "get_request", get_request)
        with _connect(proxy.url) as held:
            held.sendall(b"GET /v1/decode_work?instance=d0&timeout=20 HTTP/1.1\r\n"
                         b"Host: x\r\n\r\n")
            assert proxy.waiting.acquire(timeout=WAIT)  # being served: its poll waits
            assert _exchange(proxy.url, _HEALTH) == _BUSY
            assert _until_eof(held) == b""  # cut


def test_f1_each_attempt_waits_twice_as_long_within_the_budget(monkeypatch) -> None:
    """A proxy that is only slow is heard by a later, longer attempt; one that never
    answers is given up on once the attempts' waits fill the budget."""
    from sfa_rd2h.runtime import metaserver

    waits: list[float] = []
    now = [0.0]

    class Silent:
        """Every attempt times out, taking the whole time it was given."""

        def open(self, req, timeout: float):  # noqa: ANN001
            waits.append(timeout)
            now[0] += timeout
            raise TimeoutError("timed out")

    monkeypatch.setattr(metaserver, "_OPENER", Silent())
    kw = {"sleep": lambda _: None, "clock": lambda: now[0]}
    with pytest.raises(MetaserverUnreachable, match="after 4 attempt"):
        post_rendezvous("http://127.0.0.1:1/v1/metaserver", _rdv("r-0"), retries=8,
                        timeout=2.0, budget=20.0, **kw)
    assert waits == [2.0, 4.0, 8.0, 6.0]  # doubling, the last one cut to the budget
    waits.clear()
    with pytest.raises(MetaserverUnreachable, match="after 3 attempt"):  # retries bound too
        post_rendezvous("http://127.0.0.1:1/v1/metaserver", _rdv("r-0"), retries=2,
                        timeout=1.0, budget=100.0, **kw)
    assert waits == [1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="budget"):
        post_rendezvous("http://127.0.0.1:1/v1/metaserver", _rdv("r-0"), timeout=3.0,
                        budget=2.0)
