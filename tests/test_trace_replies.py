"""The trace validator judges each Decode reply against the layer read it answers (W3, F2):
a trace whose machine state says one thing and whose wire says another is a divergence."""

from __future__ import annotations

import json
from pathlib import Path

from sfa_rd2h.model_check.cluster import Cluster, RequestSpec, Scope
from sfa_rd2h.statemachines.trace import validate


def _traced_run(folder: Path, fail_first_read: bool = False) -> list[Path]:
    """A small deterministic model run recorded with the runtime's Tracer."""
    scope = Scope(p_tp=1, d_tp=1, n_layers=2, n_slots=1, indexer=False,
                  requests=(RequestSpec(3, (3,)),),
                  max_faults=1 if fail_first_read else 0,
                  fault_kinds=frozenset({"fail_read"}))
    cluster = Cluster(scope, trace_dir=folder)
    failed = not fail_first_read
    while ops := cluster.enabled(faults=not failed, timers=False):
        fault = [op for op in ops if op[0] == "fail_read"]
        cluster.apply(fault[0] if fault else ops[0])
        failed = failed or bool(fault)
    cluster.check_quiescent()
    cluster.close_traces()
    return sorted(folder.glob("*.jsonl"))


def _edit(path: Path, event: str, old: str, new: str) -> int:
    """Change the first ``decode_layer_read`` ``event`` into ``old`` so that it goes to
    ``new``; returns the edited line number."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if rec.get("m") == "decode_layer_read" and rec["ev"] == event and rec["dst"] == old:
            rec["dst"] = new
            lines[i] = json.dumps(rec)
            path.write_text("\n".join(lines) + "\n")
            return i + 1
    raise AssertionError(f"no {event} -> {old} in {path}")


def _reply_line(path: Path, kind: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        rec = json.loads(line)
        if rec["k"] == "msg" and rec["dir"] == "send" and rec["kind"] == kind:
            return i
    raise AssertionError(f"no {kind} sent in {path}")


def test_a_read_marked_failed_but_answered_read_done_is_a_divergence(tmp_path: Path) -> None:
    traces = _traced_run(tmp_path)
    assert validate(traces).ok
    decode = next(p for p in traces if p.name.startswith("decode"))
    # The table allows read_completed: reading -> failed, so the transition alone is fine;
    # only the READ_DONE that follows it contradicts it.
    _edit(decode, "read_completed", "done", "failed")
    report = validate(traces)
    assert not report.ok
    d = report.divergence
    assert d is not None and d.rule == "F2" and d.path == str(decode)
    assert d.line == _reply_line(decode, "read_done")
    assert "ended 'failed'" in d.message and "calls for read_failed" in d.message


def test_a_failed_read_reported_done_in_the_machine_is_a_divergence(tmp_path: Path) -> None:
    traces = _traced_run(tmp_path, fail_first_read=True)
    report = validate(traces)
    assert report.ok, report.summary()
    decode = next(p for p in traces if p.name.startswith("decode"))
    _edit(decode, "read_completed", "failed", "done")
    report = validate(traces)
    assert report.divergence is not None and report.divergence.rule == "W3"
    assert report.divergence.line == _reply_line(decode, "read_failed")
