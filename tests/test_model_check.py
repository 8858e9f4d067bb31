"""The model checker: correct cores pass, every seeded bug is caught, counts are pinned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sfa_rd2h.model_check import mutants
from sfa_rd2h.model_check.checker import run_check
from sfa_rd2h.model_check.cluster import Cluster, RequestSpec, Scope, scope_from_json
from sfa_rd2h.model_check.explore import DEFAULT_SCOPE, EARLY_SCOPE, explore
from sfa_rd2h.model_check.invariants import InvariantViolation
from sfa_rd2h.runtime.tools.cli import main
from sfa_rd2h.spec.errors import TopologyError
from sfa_rd2h.statemachines.cores.decode import DecodeCore

PINNED = Path(__file__).parent / "data" / "mutant_counterexamples.json"

# The number of distinct states of DEFAULT_SCOPE. A change here means the protocol's
# behaviour changed: review it like a change of the spec snapshot. 952 -> 1046 when Decode
# took over the cut (T6): the indexer pieces now rotate by the chunk's start, so members
# write different blocks first and more memory interleavings are distinct.
PINNED_STATES = 1046


@pytest.mark.parametrize("p_tp, d_tp", [(3, 2), (2, 4), (0, 1)])
def test_invalid_topologies_are_rejected_up_front(p_tp, d_tp):
    with pytest.raises(TopologyError, match="T1"):
        Cluster(Scope(p_tp=p_tp, d_tp=d_tp))


def _run_to_end(cluster: Cluster) -> None:
    while ops := cluster.enabled(faults=False, timers=False):
        cluster.apply(ops[-1])
    cluster.check_quiescent()


@pytest.mark.parametrize("p_tp, d_tp, indexer, scale", [
    (1, 1, False, False), (2, 1, True, False), (4, 2, True, True), (4, 1, True, True)])
def test_every_ratio_moves_every_byte(p_tp, d_tp, indexer, scale):
    scope = Scope(p_tp=p_tp, d_tp=d_tp, n_layers=3, n_slots=2, indexer=indexer, scale=scale,
                  requests=(RequestSpec(9, (5, 9)), RequestSpec(3, (3,), None, 0),
                            RequestSpec(2, (2,), 0, 0)), d_instances=2, max_faults=0)
    cluster = Cluster(scope)
    _run_to_end(cluster)
    assert cluster.outcome == {0: True, 1: True, 2: True}  # bytes checked on each success


def test_read_failure_fails_the_request_and_frees_the_gate():  # R5, S4, F2
    cluster = Cluster(Scope(max_faults=1, fault_kinds=frozenset({"fail_read"})))
    cluster.apply(("fail_read", 0))
    _run_to_end(cluster)
    assert sorted(cluster.outcome.values()) == [False, True] or not all(cluster.outcome.values())
    assert cluster.p_errors >= 1  # the compute path observed the failed gate


def test_layout_mismatch_fails_cleanly():  # L1
    cluster = Cluster(Scope(layout_mismatch_layer=1, max_faults=0))
    _run_to_end(cluster)
    assert cluster.outcome == {0: False, 1: False}


def test_explorer_count_is_pinned():
    result = explore(DEFAULT_SCOPE)
    assert result.complete
    assert result.final_states == 1  # every interleaving converges to one outcome
    assert result.states == PINNED_STATES


def test_explorer_finds_a_seeded_bug():
    with pytest.raises(InvariantViolation, match="S3"):
        explore(DEFAULT_SCOPE,
                cluster_factory=lambda s: Cluster(s, decode_cls=mutants.SilentEmptyLayer))


class _NeverForgets(DecodeCore):
    """Decode that keeps waiting for a request vLLM ended before allocating it."""

    def forget_unregistered(self, ext_req_id: str, now: float) -> list:
        return []


def test_early_dispatch_explored_whole_and_a_decode_writing_its_prefix_caught():  # C3, C5, C1
    """Prefill sent both requests before their rendezvous and told no cached tokens, while
    Decode holds the first block of one itself, and either request's client may leave
    before Decode admits it: every interleaving keeps that block untouched and ends in one
    outcome per set of requests left (the count is pinned). A Decode that reads every
    position it is sent breaks C5; one that keeps waiting for a request its vLLM ended
    unallocated leaves a READY unanswered (S3, without timers)."""
    result = explore(EARLY_SCOPE)
    assert result.complete and result.final_states == 4
    assert result.states == 1442
    with pytest.raises(InvariantViolation, match="C5"):
        explore(EARLY_SCOPE,
                cluster_factory=lambda s: Cluster(s, decode_cls=mutants.WritesOwnPrefix))
    with pytest.raises(InvariantViolation, match="S3 violated: P0<->D0: 1 READY but 0 replies"):
        explore(EARLY_SCOPE, cluster_factory=lambda s: Cluster(s, decode_cls=_NeverForgets))


def test_checker_passes_on_the_correct_cores():
    # A fixed number of seeded deployments: the same in CI on any machine.
    examples = int(os.environ.get("SFA_RD2H_CHECK_EXAMPLES", "300"))
    result = run_check(float("inf"), seed_value=1, max_examples=examples)
    assert result.ok, "\n".join(result.counterexample + [result.error])
    assert result.examples == examples


def test_catalog_covers_known_failures_and_every_rule_group():
    names = {b.name for b in mutants.BUGS}
    assert {"ack_from_any_reader", "no_rehandshake_after_restart", "trust_first_ratio",
            "notify_before_landed", "fail_without_waiting", "write_after_terminal",
            "cached_tokens_keyerror"} <= names
    groups = {r.rstrip("0123456789") for b in mutants.BUGS for r in b.rules}
    assert {"S", "R", "T", "L", "W", "C", "F"} <= groups


def _pinned() -> list[dict]:
    return json.loads(PINNED.read_text())


def test_every_non_equivalent_bug_has_a_pinned_counterexample():
    pinned = {entry["name"] for entry in _pinned()}
    expected = {b.name for b in mutants.BUGS if not b.equivalent}
    assert expected <= pinned


@pytest.mark.parametrize("entry", _pinned(), ids=lambda e: e["name"])
def test_pinned_counterexample(entry):
    """The minimal counterexample still kills its bug, and the same schedule is harmless on
    the correct cores (as far as the correct cores allow it to run)."""
    bug = mutants.BY_NAME[entry["name"]]
    scope = scope_from_json(entry["scope"])
    ops = [tuple(op) for op in entry["ops"]]
    with pytest.raises(Exception) as caught:  # noqa: PT011 - any escape is a kill
        cluster = Cluster(scope, bug.prefill, bug.decode)
        for op in ops:
            cluster.apply(op)
        if not cluster.progress_pending():
            cluster.check_quiescent()
    assert entry["error"] in f"{type(caught.value).__name__}: {caught.value}"

    correct = Cluster(scope)
    for op in ops:
        if op not in correct.enabled():
            break
        correct.apply(op)
    else:
        if not correct.progress_pending():
            correct.check_quiescent()


def test_mutants_cli_json(capsys):
    assert main(["mutants", "--only", "notify_before_landed", "--budget", "20", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert set(row) == {"name", "rules", "killed", "seconds", "steps", "equivalent"}
    assert row["killed"] and row["rules"] == ["C4"] and row["steps"] >= 2


def test_check_cli_reports_a_counterexample(capsys, monkeypatch):
    from sfa_rd2h.model_check import checker

    real = checker.run_check
    monkeypatch.setattr(checker, "run_check", lambda budget, seed_value, **kw: real(
        budget, seed_value, prefill_cls=mutants.NotifyBeforeLanded, **kw))
    assert main(["check", "--budget", "20", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "counterexample:" in out and "  1. deploy" in out and "C4 violated" in out


@pytest.mark.parametrize("seed", range(12))
def test_model_runs_pass_the_runtime_trace_validator(tmp_path, seed):
    """The checker's executions, recorded by the runtime's Tracer, replay cleanly through
    `sfa-rd2h validate`: model and runtime judge the protocol by the same tables."""
    import random

    from sfa_rd2h.statemachines.trace import validate

    rng = random.Random(seed)
    scope = Scope(p_tp=4, d_tp=2, n_layers=3, n_slots=2, scale=True,
                  requests=(RequestSpec(9, (5, 9)), RequestSpec(3, (3,), None, 0),
                            RequestSpec(2, (2,), 0, 0)), max_faults=2,
                  # faults a real network can produce; duplicated or forged frames would be
                  # (rightly) reported by the validator's S3 pairing
                  fault_kinds=frozenset({"fail_read", "restart_decode"}))
    cluster = Cluster(scope, trace_dir=tmp_path)
    while ops := cluster.enabled():
        cluster.apply(rng.choice(ops))
    cluster.check_quiescent()
    cluster.close_traces()
    report = validate(sorted(tmp_path.glob("*.jsonl")))
    assert report.ok, report.summary()
    assert sum(1 for _ in tmp_path.glob("*.jsonl")) >= scope.p_tp + scope.d_tp
    assert " 0 messages" not in report.summary()


def test_runtime_trace_validator_flags_duplicated_replies_in_model_runs(tmp_path):
    """The other direction: a fault the cores tolerate (a duplicated reply, S5) is still an
    anomaly on the wire, and the validator reports it from the model's traces (S3)."""
    import random

    from sfa_rd2h.statemachines.trace import validate

    flagged = []
    for seed in range(12):
        folder = tmp_path / str(seed)
        rng = random.Random(seed)
        cluster = Cluster(Scope(p_tp=2, d_tp=1, n_layers=2, n_slots=1, max_faults=2,
                                fault_kinds=frozenset({"dup_reply"})), trace_dir=folder)
        while ops := cluster.enabled():
            cluster.apply(rng.choice(ops))
        cluster.close_traces()
        report = validate(sorted(folder.glob("*.jsonl")))
        if cluster.faults and not report.ok:
            flagged.append(report.divergence.rule)
    assert flagged and set(flagged) == {"S3"}
