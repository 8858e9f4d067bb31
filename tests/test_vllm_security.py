"""Only the deployment's own processes get in (issue 19 item 7), the proxy's half: with a
token, every endpoint but the health probes answers 401 to a caller without it and changes
nothing, Decode's rendezvous client and the connectors' failure reports get through with
it, and the token goes no further than the proxy."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import httpx  # noqa: E402 - installed with vLLM
from vllm_support import Backends, fake_tokens  # noqa: E402

from sfa_rd2h.runtime.metaserver import (  # noqa: E402
    ProxyRequestError,
    Rendezvous,
    failure_url,
    post_rendezvous,
    report_kv_failure,
)
from sfa_rd2h.runtime.vllm.proxy import DisaggProxy, main  # noqa: E402

pytestmark = pytest.mark.timeout(60)
TOKEN = "deployment-token-1"


@pytest.fixture
def guarded(monkeypatch) -> Iterator[tuple[Backends, DisaggProxy]]:
    # The fake Decode posts its rendezvous as the real one does: with the environment's
    # token (the connector's metaserver_token_file or SFA_RD2H_METASERVER_TOKEN).
    monkeypatch.setenv("SFA_RD2H_METASERVER_TOKEN", TOKEN)
    b = Backends().start()
    assert b.prefill is not None and b.decode is not None
    proxy = DisaggProxy([b.prefill.url], [b.decode.url], token=TOKEN)
    proxy.start()
    yield b, proxy
    proxy.close()
    b.close()


def _post(url: str, token: str | None, **kw) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.post(url, headers=headers, trust_env=False, timeout=20, **kw)


def test_without_the_token_nothing_gets_in_and_nothing_changes(guarded):
    b, proxy = guarded
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    rdv = Rendezvous(request_id="cmpl-x-0", remote_engine_id="e", remote_host="10.0.0.9",
                     remote_port=5000, remote_tp_size=1).to_json()
    for token, words in ((None, "requires a bearer token"), ("wrong", "token is wrong")):
        for url, kw in ((f"{proxy.url}/v1/completions", {"json": body}),
                        (proxy.metaserver_url, {"json": rdv}),
                        (failure_url(proxy.metaserver_url),
                         {"json": {"request_id": "cmpl-x-0", "error": "e"}})):
            r = _post(url, token, **kw)
            assert r.status_code == 401, (url, r.text)
            assert words in r.json()["error"]["message"] and TOKEN not in r.text
            assert r.headers["www-authenticate"] == "Bearer"
        for path in ("/v1/proxy/jobs", "/v1/proxy/in-flight"):
            r = httpx.get(f"{proxy.url}{path}", trust_env=False,
                          headers={} if token is None else {"Authorization": f"Bearer {token}"})
            assert r.status_code == 401, path
    assert b.decode_calls == [] and b.prefill_calls == [] and proxy.jobs_in_flight == 0
    assert post_rendezvous(proxy.metaserver_url, Rendezvous.from_json(rdv), token="") == 401
    for probe in ("/health", "/healthcheck"):  # orchestrators probe without credentials
        assert httpx.get(f"{proxy.url}{probe}", trust_env=False).status_code == 200


def test_with_the_token_a_completion_works_and_the_token_stays_at_the_proxy(guarded):
    b, proxy = guarded
    prompt = [5, 6, 7, 8]
    r = _post(f"{proxy.url}/v1/completions", TOKEN,
              json={"model": "m", "prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == fake_tokens(prompt, 3)
    assert [status for _, status in b.posted] == [200]  # Decode's rendezvous got in
    (d_call,) = b.decode_calls
    assert d_call["authorization"] is None  # not forwarded to the engines
    assert len(proxy.records(1, timeout=10.0)) == 1  # written once Prefill's answer is in
    jobs = httpx.get(f"{proxy.url}/v1/proxy/jobs", trust_env=False,
                     headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert jobs[-1]["outcome"] == "ok"


def test_a_failure_report_with_the_token_is_heard(guarded):
    b, proxy = guarded
    b.prefill_mode = "lost"  # the fake Prefill's reporter sends the environment's token
    r = _post(f"{proxy.url}/v1/completions", TOKEN,
              json={"model": "m", "prompt": [9, 9], "max_tokens": 2})
    assert r.status_code == 502 and "MF_META not acknowledged" in r.json()["error"]["message"]
    with pytest.raises(ProxyRequestError, match="401"):  # and without it, it is not
        report_kv_failure(proxy.metaserver_url, "cmpl-x-0", "e", reporter="t", token="")


def test_without_a_token_the_clients_credentials_reach_the_engines(monkeypatch):
    monkeypatch.delenv("SFA_RD2H_METASERVER_TOKEN", raising=False)
    b = Backends().start()
    assert b.prefill is not None and b.decode is not None
    proxy = DisaggProxy([b.prefill.url], [b.decode.url])
    proxy.start()
    try:
        r = _post(f"{proxy.url}/v1/completions", "engine-api-key",
                  json={"model": "m", "prompt": [1], "max_tokens": 1})
        assert r.status_code == 200
        assert b.decode_calls[0]["authorization"] == "Bearer engine-api-key"  # vLLM's --api-key
    finally:
        proxy.close()
        b.close()


def test_the_command_line_reads_the_token_from_a_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--prefill", "http://p:1", "--decode", "http://d:2",
              "--token-file", str(tmp_path / "missing")])
    assert "--token-file" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit):
        main(["--prefill", "http://p:1", "--decode", "http://d:2",
              "--token-file", str(tmp_path / "empty")])
    assert "is empty" in capsys.readouterr().err


def test_concurrent_callers_with_and_without_the_token(guarded):
    """The check holds per request under concurrency: each gets its own answer."""
    _, proxy = guarded
    results: dict[int, int] = {}

    def call(i: int) -> None:
        r = _post(f"{proxy.url}/v1/completions", TOKEN if i % 2 else None,
                  json={"model": "m", "prompt": [i + 1], "max_tokens": 1})
        results[i] = r.status_code

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {i: 200 if i % 2 else 401 for i in range(8)}
