"""A failure reaches the client as soon as a process knows it (issue 19 item 5): Prefill's
report of a request whose KV will not reach Decode (S5, S7) ends the completion at once
with that cause, a rendezvous that cannot be right is refused, and the connector's Prefill
rank turns a reader it gave up on into such a report."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("vllm")

import httpx  # noqa: E402 - installed with vLLM
from vllm_support import Backends  # noqa: E402

from sfa_rd2h.runtime.metaserver import failure_url, report_kv_failure  # noqa: E402
from sfa_rd2h.runtime.vllm.failures import FailureReporter, handshake_hint  # noqa: E402
from sfa_rd2h.runtime.vllm.proxy import DisaggProxy, loopback_across_hosts  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lost() -> Iterator[tuple[Backends, DisaggProxy]]:
    b = Backends().start()
    b.prefill_mode = "lost"
    assert b.prefill is not None and b.decode is not None
    proxy = DisaggProxy([b.prefill.url], [b.decode.url])
    proxy.start()
    yield b, proxy
    proxy.close()
    b.close()


def test_prefill_is_told_where_to_report(lost):
    b, proxy = lost
    httpx.post(f"{proxy.url}/v1/completions", trust_env=False, timeout=20,
               json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    (p_call,) = b.prefill_calls
    assert p_call["body"]["kv_transfer_params"]["metaserver"] == proxy.metaserver_url


def test_a_failure_report_ends_the_completion_at_once(lost):
    b, proxy = lost
    t0 = time.monotonic()
    r = httpx.post(f"{proxy.url}/v1/completions", trust_env=False, timeout=20,
                   json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
    took = time.monotonic() - t0
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert "will not reach decode" in message and "MF_META not acknowledged" in message
    assert "fake prefill" in message  # who knew
    assert took < b.decode_wait_s  # not the fake Decode giving up on its KV
    assert b.decode_cancelled.wait(5.0)  # Decode's request was aborted
    b.reporter.close(5.0)  # its thread counts the answer after the proxy acted on it
    assert (b.reporter.sent, b.reporter.undelivered) == (1, 0)
    assert len(proxy.records(1, timeout=10.0)) == 1  # written once Prefill's answer is in
    jobs = httpx.get(f"{proxy.url}/v1/proxy/jobs", trust_env=False).json()
    assert "will not reach decode" in jobs[-1]["outcome"]
    assert proxy.jobs_in_flight == 0


def test_a_streamed_completion_gets_the_report_as_its_error_event(lost):
    b, proxy = lost
    with httpx.stream("POST", f"{proxy.url}/v1/completions", trust_env=False, timeout=20,
                      json={"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 2,
                            "stream": True}) as r:
        assert r.status_code == 200  # Decode's stream had started
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 2  # no token before the error
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 502 and "MF_META not acknowledged" in error["message"]
    assert b.decode_cancelled.wait(5.0)


def test_the_failure_endpoint_contract(lost):
    _, proxy = lost
    url = failure_url(proxy.metaserver_url)
    assert url == f"{proxy.url}/v1/metaserver/failed"
    for body in (b"{no json", b"[]", json.dumps({"error": "x"}).encode(),
                 json.dumps({"request_id": "r", "error": ""}).encode(),
                 json.dumps({"request_id": 7, "error": "x"}).encode()):
        r = httpx.post(url, content=body, trust_env=False)
        assert r.status_code == 400, body
    r = httpx.post(url, json={"request_id": "cmpl-nobody-0", "error": "lost"},
                   trust_env=False)
    assert r.status_code == 404 and "cmpl-nobody-0" in r.json()["error"]
    assert proxy.jobs_in_flight == 0


class _Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, dict]] = []
    got = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, body))
        self.send_response(200 if body["request_id"] != "gone" else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
        type(self).got.set()

    def log_message(self, *args: object) -> None:
        pass


def test_the_reporter_posts_off_the_callers_thread_and_counts_what_was_not_heard():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    meta = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver"
    reporter = FailureReporter("Prefill rank 0", timeout=5.0)
    _Recorder.seen.clear()
    try:
        reporter.report(None, "no-url", "nobody to tell")  # logged, nothing posted
        reporter.report(meta, "cmpl-a-0", "x" * 5000)
        reporter.report(meta, "gone", "finished already")
        reporter.close(10.0)
        assert [p for p, _ in _Recorder.seen] == ["/v1/metaserver/failed"] * 2
        first = _Recorder.seen[0][1]
        assert first["request_id"] == "cmpl-a-0" and first["reporter"] == "Prefill rank 0"
        assert len(first["error"]) == 2000  # cut, not refused
        assert (reporter.sent, reporter.undelivered) == (1, 1)
        with pytest.raises(OSError):  # nobody listening: the transport error is raised
            report_kv_failure("http://127.0.0.1:9/v1/metaserver", "r", "e", reporter="t",
                              timeout=1.0)
    finally:
        server.shutdown()
        server.server_close()


def test_hints_name_what_to_change():
    assert "`host`" in handshake_hint("MF_META not acknowledged within 5.0s")
    assert "reply_timeout" in handshake_hint("no reply within 60.0s")
    assert "lost" in handshake_hint("peer disconnected")


@pytest.mark.parametrize("remote,decode,prefill,refused", [
    ("127.0.0.1", "http://10.0.0.3:8200", "http://10.0.0.2:8100", True),
    ("localhost", "http://decode.example:8200", "http://10.0.0.2:8100", True),
    ("::1", "http://10.0.0.3:8200", "http://10.0.0.2:8100", True),
    ("127.0.0.1", "http://127.0.0.1:8200", "http://127.0.0.1:8100", False),  # one host
    ("127.0.0.1", "http://10.0.0.3:8200", "http://10.0.0.3:8100", False),  # same host
    ("10.0.0.3", "http://10.0.0.3:8200", "http://10.0.0.2:8100", False),
])
def test_a_loopback_rendezvous_across_hosts_is_refused(remote, decode, prefill, refused):
    problem = loopback_across_hosts(remote, decode, prefill)
    assert (problem is not None) == refused
    if refused:
        assert remote in problem and "kv_connector_extra_config" in problem


def test_the_prefill_core_names_each_request_it_gives_up_on_once():  # S5, S7
    from sfa_rd2h.spec import wire
    from sfa_rd2h.spec.topology import tp_mapping
    from sfa_rd2h.statemachines.cores.prefill import Abandoned, PrefillCore

    meta = wire.LayerMeta((0x10000, 0x11000, 0x12000), (16, 16, 8), (1, 1, 1), (0, 0, 1), 2,
                          True)
    core = PrefillCore(0, tp_mapping(1, 1), "10.0.0.1:1000", {"l0": meta, "l1": meta},
                       block_size=4, handshake_timeout=5.0)
    params = {"remote_host": "10.0.0.2", "remote_port": 30000, "remote_tp_size": 1}
    other = dict(params, remote_port=30001)
    for rid, p in (("r1", params), ("r2", params), ("r3", other)):
        core.add_request(rid, p, [5], [1])
        core.schedule_chunk(rid, 4, final=True)
    core.begin_layer(0, 0.0)
    core.layer_landed(0, 0.0)  # MF_META to both endpoints; READYs held for the acks
    core.on_frame("10.0.0.2:30001", wire.RAW_ACK, 0.0)  # only the second one answers
    assert core.take_abandoned() == []
    core.tick(5.0)
    assert core.take_abandoned() == [
        Abandoned("10.0.0.2:30000", r, "MF_META not acknowledged within 5.0s")
        for r in ("r1", "r2")]
    assert core.take_abandoned() == []  # taken once
    core.peer_gone("10.0.0.2:30000", 6.0, "again")  # nothing outstanding there any more
    assert core.take_abandoned() == []


def test_the_sender_thread_tells_of_a_reader_that_never_answered():  # S5, S7, W1
    import socket

    from sfa_rd2h.runtime.control import PrefillWorker
    from sfa_rd2h.spec import wire
    from sfa_rd2h.spec.topology import tp_mapping
    from sfa_rd2h.statemachines.cores.prefill import PrefillCore

    meta = wire.LayerMeta((0x10000, 0x11000, 0x12000), (16, 16, 8), (1, 1, 1), (0, 0, 1), 2,
                          True)
    told: list = []
    heard = threading.Event()

    def on_abandoned(item) -> None:
        told.append((item, threading.current_thread().name))
        heard.set()

    core = PrefillCore(0, tp_mapping(1, 1), "10.0.0.1:1000", {"l0": meta}, block_size=4,
                       handshake_timeout=0.5)
    with socket.socket() as mute:  # accepts TCP, never speaks ZMTP: MF_META goes unanswered
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        port = mute.getsockname()[1]
        worker = PrefillWorker(core, on_abandoned=on_abandoned)
        try:
            worker.add_request("r1", {"remote_host": "127.0.0.1", "remote_port": port,
                                      "remote_tp_size": 1}, [5], [1])
            worker.schedule_chunk("r1", 4, True)
            worker.wait_for_layer_send(0, 10.0)
            worker.begin_layer(0)
            worker.layer_written(0, None)
            assert heard.wait(20.0)
        finally:
            worker.close()
    [(item, thread)] = told
    assert (item.endpoint, item.ext_req_id) == (f"127.0.0.1:{port}", "r1")
    assert "MF_META not acknowledged within 0.5s" in item.reason
    assert thread == "prefill0-sender"


def test_a_report_that_meets_a_transport_error_is_retried_until_heard():
    """The link that lost Decode may have cut the proxy off too; it comes back."""
    import logging
    import socket

    retrying = threading.Event()

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying" in record.getMessage():
                retrying.set()

    spy = Spy(logging.INFO)
    logger = logging.getLogger("sfa_rd2h.runtime.vllm.failures")
    logger.addHandler(spy)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: a connect is refused
    port = sock.getsockname()[1]
    reporter = FailureReporter("Prefill rank 0", timeout=5.0)
    _Recorder.seen.clear()
    _Recorder.got.clear()
    server = None
    try:
        reporter.report(f"http://127.0.0.1:{port}/v1/metaserver", "cmpl-b-0", "lost")
        assert retrying.wait(10.0)  # the first attempt was refused
        server = ThreadingHTTPServer(("127.0.0.1", port), _Recorder, bind_and_activate=False)
        server.socket.close()
        server.socket = sock  # the very port the report goes to, now listening
        server.server_activate()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        assert _Recorder.got.wait(10.0)  # the retry, 0.5 s later, was heard
        assert [b["request_id"] for _, b in _Recorder.seen] == ["cmpl-b-0"]
    finally:
        reporter.close(10.0)
        logger.removeHandler(spy)
        logger.setLevel(old_level)
        if server is not None:
            server.shutdown()
        sock.close()
    assert (reporter.sent, reporter.undelivered) == (1, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_decodes_reported_cause_replaces_vllms_bare_error(stream):  # F2
    """vLLM answers a failed KV load with "Internal server error"; the connector's report of
    the cause, racing that answer, is what the client reads."""
    b = Backends().start()
    b.decode_mode = "read_failed"
    assert b.prefill is not None and b.decode is not None
    proxy = DisaggProxy([b.prefill.url], [b.decode.url])
    proxy.start()
    try:
        body = {"model": "m", "prompt": [4, 5, 6], "max_tokens": 2, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=20,
                              trust_env=False) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) == 2
            message = json.loads(lines[0][6:])["error"]["message"]
        else:
            r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=20,
                           trust_env=False)
            assert r.status_code == 502  # as when the report comes first
            message = r.json()["error"]["message"]
            assert "(decode answered 500: no KV)" in message  # Decode's own words kept
        assert "serves readers on this host only" in message and "Decode rank 0" in message
    finally:
        proxy.close()
        b.close()
