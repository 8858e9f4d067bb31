"""The trace validator's machine and cross-process rules, one planted defect each (issue 12):
what ``sfa-rd2h validate`` must call a divergence in traces written by real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sfa_rd2h.statemachines.trace import Tracer, validate


def _decode_rank(path: Path, request: str, ends: str | None, *, closed: bool = True) -> Path:
    """A Decode rank's trace: ``request`` registered, locally ok, and agreed ``ends``
    (None: never terminal here)."""
    t = Tracer(path, path.stem, role="decode")
    t("request_status", request, "start", "", "registered", ())
    t("request_status", request, "contributor_final", "registered", "local_ok", (0, 1))
    if ends is not None:
        t("request_status", request, "tp_agreed", "local_ok", ends, (ends == "succeeded",))
    if closed:
        t.close()
    else:
        t.abandon()
    return path


def test_a_request_terminal_on_one_decode_rank_only_is_an_r1_divergence(
        tmp_path: Path) -> None:
    """R1: a request that ended on one Decode rank must end on every rank of the instance;
    a cleanly closed rank where it never did diverges, at the line where it started."""
    d0 = _decode_rank(tmp_path / "d0.jsonl", "r", "succeeded")
    d1 = _decode_rank(tmp_path / "d1.jsonl", "r", None)
    report = validate([d0, d1])
    assert [(Path(d.path).name, d.line, d.rule) for d in report.divergences] == [
        ("d1.jsonl", 2, "R1")]
    assert "'r' is terminal on another Decode rank but never reached" in report.divergences[
        0].message
    # Both ranks terminal: valid. A rank that did not close cleanly is not judged (it may
    # have been killed before it could finish).
    assert validate([d0, _decode_rank(tmp_path / "d2.jsonl", "r", "succeeded")]).ok
    assert validate([d0, _decode_rank(tmp_path / "d3.jsonl", "r", None, closed=False)]).ok


@pytest.mark.parametrize(("machine", "state"), [
    ("request_status", "local_ok"),
    ("request_status", "succeeded"),
    ("decode_layer_read", "done"),
    ("prefill_slot", "landed"),
])
def test_a_start_record_in_a_state_other_than_the_initial_one_is_a_divergence(
        tmp_path: Path, machine: str, state: str) -> None:
    """A machine instance is born in its table's initial state; a trace that starts it
    anywhere else skipped transitions the validator would have judged."""
    t = Tracer(tmp_path / "x.jsonl", "x", role="decode")
    t(machine, "k", "start", "", state, ())
    t.close()
    report = validate([tmp_path / "x.jsonl"])
    [d] = report.divergences
    assert (d.line, d.rule) == (2, "machines")
    assert f"{machine}[k] starts in {state!r}, not the initial state" in d.message


def test_a_machine_instance_started_twice_is_a_divergence(tmp_path: Path) -> None:
    """One key, one machine instance: a second start would silently reset its state (here
    a request that already failed would start over and could succeed)."""
    t = Tracer(tmp_path / "d.jsonl", "d", role="decode")
    t("request_status", "r", "start", "", "registered", ())
    t("request_status", "r", "read_failed", "registered", "local_failed", ("F2: x",))
    t("request_status", "r", "start", "", "registered", ())
    t("request_status", "r", "contributor_final", "registered", "local_ok", (0, 1))
    t.close()
    report = validate([tmp_path / "d.jsonl"])
    [d] = report.divergences
    assert (d.line, d.rule) == (4, "machines") and "request_status[r] started twice" in d.message
    # The same key in another machine is another instance.
    t = Tracer(tmp_path / "ok.jsonl", "ok", role="decode")
    t("request_status", "k", "start", "", "registered", ())
    t("decode_layer_read", "k", "start", "", "received", ())
    t.close()
    assert validate([tmp_path / "ok.jsonl"]).ok
