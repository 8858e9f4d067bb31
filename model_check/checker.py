"""The hypothesis stateful model checker over a whole deployment.

``ClusterMachine`` draws a deployment scope (TP ratio, layers on a ring of slots, indexer,
LIC8 scale, chunked and prompt-list requests, legacy contributors, layout mismatches), then
applies operations of ``Cluster`` one at a time: progress (compute, deliveries, reads,
registration, agreement, timers) and a bounded number of faults. Invariants are evaluated
inside the operations and, when nothing can progress, quiescence is checked.

``run_check`` and ``run_mutant`` drive it in deterministic, seeded batches against a time
budget and turn a failure into a numbered, readable counterexample.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as conjecture_engine
from hypothesis.reporting import with_reporter
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sfa_rd2h.model_check.cluster import FAULT_KINDS, FAULT_OPS, Cluster, RequestSpec, Scope
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import PrefillCore

TOPOLOGIES = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4))
OPS_PER_RULE = 40
# Progress first, faults last: shrinking moves choices toward lower indices, so minimal
# counterexamples prefer ordinary progress over faults.
KIND_ORDER = ("prefill", "to_decode", "read", "to_prefill", "rendezvous", "register", "agree",
              "abandon", "tick", *FAULT_OPS)

settings.register_profile(
    "checker", deadline=None, stateful_step_count=4, max_examples=40, database=None,
    suppress_health_check=list(HealthCheck), derandomize=False, print_blob=False,
    report_multiple_bugs=False)
# CI: hypothesis' own "ci" profile (derandomized, no example database) with the checker's
# step and health-check settings. Runs are seeded on top, so CI replays the same deployments.
settings.register_profile(
    "checker-ci", parent=settings.get_profile("ci"), deadline=None, stateful_step_count=4,
    suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False)
settings.register_profile(
    "fuzz", deadline=None, stateful_step_count=10, max_examples=2000, database=None,
    suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


def default_profile() -> str:
    """``SFA_RD2H_PROFILE`` if set (``fuzz`` for nightly runs), ``checker-ci`` when ``CI`` is
    set, else ``checker``. Runs are seeded, so the same seed and example count replay the
    same deployments."""
    explicit = os.environ.get("SFA_RD2H_PROFILE")
    if explicit:
        return explicit
    return "checker-ci" if os.environ.get("CI") else "checker"


@st.composite
def request_specs(draw: st.DrawFn, group: int) -> RequestSpec:
    tokens = draw(st.integers(1, 10))
    chunked = tokens > 4 and draw(st.booleans())
    chunks = (draw(st.integers(1, tokens - 1)), tokens) if chunked else (tokens,)
    cached = draw(st.sampled_from([0, None] + ([4] if chunks[0] > 4 else [])))
    return RequestSpec(tokens, chunks, cached, group)


@st.composite
def scopes(draw: st.DrawFn) -> Scope:
    p_tp, d_tp = draw(st.sampled_from(TOPOLOGIES))
    fault_kinds = draw(st.frozensets(st.sampled_from(FAULT_KINDS), min_size=1, max_size=2))
    n_layers = draw(st.integers(2, 3))
    n_slots = draw(st.integers(1, n_layers - 1))
    indexer = draw(st.booleans())
    scale = indexer and draw(st.booleans())
    n_req = draw(st.integers(1, 3))
    groups = draw(st.lists(st.sampled_from([-1, 0]), min_size=n_req, max_size=n_req))
    requests = tuple(draw(request_specs(g)) for g in groups)
    ratio = p_tp // d_tp
    # "empty" took the places of two "none"s: the same draws pick the same deployments
    special = draw(st.sampled_from(["none", "empty", "empty", "legacy", "mismatch"]))
    return Scope(
        p_tp=p_tp, d_tp=d_tp, n_layers=n_layers, n_slots=n_slots, indexer=indexer,
        scale=scale, requests=requests,
        layout_mismatch_layer=draw(st.integers(0, n_layers - 1)) if special == "mismatch"
        else None,
        legacy_rank=1 if special == "legacy" and ratio >= 2 else None,
        empty_entries=special == "empty" and any(len(r.chunks) > 1 for r in requests),
        d_instances=draw(st.integers(1, 2)),
        max_faults=draw(st.integers(0, 3)),
        fault_kinds=fault_kinds,
        early_dispatch=draw(st.booleans()),  # drawn last: earlier draws pick as before
    )


class ClusterMachine(RuleBasedStateMachine):
    """A whole P/D deployment under arbitrary interleavings and faults."""

    prefill_cls: type[PrefillCore] = PrefillCore
    decode_cls: type[DecodeCore] = DecodeCore
    trace: list[str] = []
    ops: list[tuple] = []
    scope: Scope | None = None
    first_failure: float | None = None
    on_first_failure: Callable[[], None] | None = None  # progress: shrinking starts now
    deployments = 0  # deployments started (shrinking replays included)

    @initialize(scope=scopes())
    def deploy(self, scope: Scope) -> None:
        type(self).deployments += 1
        type(self).trace = self.trace = [f"deploy {describe_scope(scope)}"]
        type(self).ops = self.ops = []
        type(self).scope = scope
        self._guard(lambda: setattr(self, "cluster",
                                    Cluster(scope, self.prefill_cls, self.decode_cls)), "deploy")

    def _guard(self, fn: Callable[[], object], what: str) -> None:
        try:
            out = fn()
        except BaseException as exc:
            self.trace.append(f"{what} raised {type(exc).__name__}: {exc}")
            if type(self).first_failure is None:
                type(self).first_failure = time.perf_counter()
                if type(self).on_first_failure is not None:
                    type(self).on_first_failure()
            raise
        if isinstance(out, str):
            self.trace.append(out)

    def _do(self, op: tuple) -> None:
        self.ops.append(op)
        self._guard(lambda: self.cluster.apply(op), f"{op[0]}{op[1:]}")

    @precondition(lambda self: hasattr(self, "cluster"))
    @rule(data=st.data())
    def run_operations(self, data: st.DataObject) -> None:
        """Apply up to ``OPS_PER_RULE`` operations, each drawn by kind first so that
        deliveries, computation, scheduling, timers and each fault kind get their turn.

        Drawing plain integers here instead of one hypothesis rule per operation keeps the
        per-step cost of the checker close to the cost of the cores themselves.
        """
        for _ in range(OPS_PER_RULE):
            by_kind = self.cluster.enabled_by_kind()
            if not by_kind:
                return
            kinds = sorted(by_kind, key=KIND_ORDER.index)
            ops = by_kind[kinds[_pick(data, len(kinds))]]
            op = ops[_pick(data, len(ops))]
            self._do(op)
            if not self.cluster.progress_pending():
                self._guard(self.cluster.check_quiescent, "network drained, no timer pending:")

    @invariant()
    def nothing_hangs(self) -> None:
        if hasattr(self, "cluster") and not self.cluster.progress_pending():
            self._guard(self.cluster.check_quiescent, "network drained, no timer pending:")


def _pick(data: st.DataObject, n: int) -> int:
    return data.draw(_INDEX[n]) if n > 1 else 0


_INDEX = {n: st.integers(0, n - 1) for n in range(2, 256)}


def describe_scope(s: Scope) -> str:
    reqs = ", ".join(
        f"{t}tok/{'+'.join(map(str, r.chunks))}"
        f"{'' if r.cached_tokens == 0 else ' no-cached-param' if r.cached_tokens is None else f' cached={r.cached_tokens}'}"  # noqa: E501
        f"{' list' if r.group >= 0 else ''}"
        for t, r in ((r.tokens, r) for r in s.requests))
    extra = []
    if s.legacy_rank is not None:
        extra.append(f"P{s.legacy_rank} runs a legacy build")
    if s.empty_entries:
        extra.append("Prefill sends zero-block entries")
    if s.layout_mismatch_layer is not None:
        extra.append(f"Decode layout of layer {s.layout_mismatch_layer} differs")
    if s.early_dispatch:
        extra.append("Prefill dispatched before the rendezvous, told no cached tokens")
    return (f"p_tp={s.p_tp} d_tp={s.d_tp}, {s.n_layers} layers on {s.n_slots} slot(s), "
            f"indexer={'yes' if s.indexer else 'no'}{'+scale' if s.scale else ''}, "
            f"requests [{reqs}], up to {s.max_faults} faults"
            + (", " + ", ".join(extra) if extra else ""))


@dataclass
class CheckResult:
    ok: bool
    examples: int
    seconds: float
    first_failure: float | None = None
    counterexample: list[str] = field(default_factory=list)
    error: str = ""
    scope: Scope | None = None
    ops: list[tuple] = field(default_factory=list)
    deployed: int = 0  # deployments started, discarded and shrinking replays included


def _machine_for(prefill_cls: type[PrefillCore], decode_cls: type[DecodeCore],
                 on_shrink: Callable[[], None] | None = None) -> type:
    return type(f"Check_{prefill_cls.__name__}_{decode_cls.__name__}", (ClusterMachine,),
                {"prefill_cls": prefill_cls, "decode_cls": decode_cls, "trace": [], "ops": [],
                 "scope": None, "first_failure": None, "deployments": 0,
                 "on_first_failure": staticmethod(on_shrink) if on_shrink else None})


def run_check(budget: float, seed_value: int = 0, *, prefill_cls: type[PrefillCore] = PrefillCore,
              decode_cls: type[DecodeCore] = DecodeCore, batch: int = 25,
              on_progress: Callable[[float, int], None] | None = None,
              profile: str | None = None, shrink_seconds: float = 30.0,
              max_examples: int | None = None,
              on_shrink: Callable[[], None] | None = None) -> CheckResult:
    """Run seeded batches until ``budget`` seconds pass (or exactly ``max_examples``
    deployments ran) or a counterexample appears.

    Batch ``k`` uses seed ``seed_value * 1_000_003 + k``, so a run is reproducible; with
    ``max_examples`` it does not even depend on the machine's speed (what CI uses).
    Shrinking a counterexample is bounded by ``shrink_seconds``; ``on_shrink`` is called
    when it starts (the first failure was found), so a progress display can say so.
    """
    if max_examples is not None and max_examples < 1:
        raise ValueError(f"max_examples must be >= 1, got {max_examples}")
    machine = _machine_for(prefill_cls, decode_cls, on_shrink)
    base = settings.get_profile(profile or default_profile())
    start = time.perf_counter()
    examples = 0
    k = 0
    saved = conjecture_engine.MAX_SHRINKING_SECONDS
    conjecture_engine.MAX_SHRINKING_SECONDS = max(1, int(shrink_seconds))
    try:
        while True:
            # The last batch is cut short so that exactly max_examples deployments run.
            size = batch if max_examples is None else min(batch, max_examples - examples)
            conf = settings(base, max_examples=size)
            seeded = seed(seed_value * 1_000_003 + k)(machine)
            try:
                # Our own numbered trace replaces hypothesis' report (which would also mix
                # its shrinking notices into --json output).
                with with_reporter(lambda _msg: None):
                    run_state_machine_as_test(seeded, settings=conf)
            except BaseException as exc:  # noqa: BLE001 - any escape is a counterexample
                first = machine.first_failure
                return CheckResult(False, examples + size, time.perf_counter() - start,
                                   (first - start) if first else None, list(machine.trace),
                                   f"{type(exc).__name__}: {exc}", machine.scope,
                                   list(machine.ops), machine.deployments)
            examples += size
            k += 1
            elapsed = time.perf_counter() - start
            if on_progress is not None:
                on_progress(elapsed, examples)
            if elapsed >= budget or (max_examples is not None and examples >= max_examples):
                return CheckResult(True, examples, elapsed, deployed=machine.deployments)
    finally:
        conjecture_engine.MAX_SHRINKING_SECONDS = saved


def format_counterexample(result: CheckResult) -> str:
    lines = [f"  {i:>3}. {step}" for i, step in enumerate(result.counterexample, 1)]
    return "\n".join(["counterexample:", *lines, f"  => {result.error.splitlines()[0]}"])
