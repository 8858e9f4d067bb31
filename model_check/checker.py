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
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sfa_rd2h.model_check.cluster import Cluster, RequestSpec, Scope
from sfa_rd2h.runtime.decode_core import DecodeCore
from sfa_rd2h.runtime.prefill_core import PrefillCore

TOPOLOGIES = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4))

settings.register_profile(
    "checker", deadline=None, stateful_step_count=80, max_examples=40, database=None,
    suppress_health_check=list(HealthCheck), derandomize=False, print_blob=False,
    report_multiple_bugs=False)
settings.register_profile(
    "fuzz", deadline=None, stateful_step_count=200, max_examples=2000, database=None,
    suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


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
    n_layers = draw(st.integers(2, 3))
    n_slots = draw(st.integers(1, n_layers - 1))
    indexer = draw(st.booleans())
    scale = indexer and draw(st.booleans())
    n_req = draw(st.integers(1, 3))
    groups = draw(st.lists(st.sampled_from([-1, 0]), min_size=n_req, max_size=n_req))
    requests = tuple(draw(request_specs(g)) for g in groups)
    ratio = p_tp // d_tp
    special = draw(st.sampled_from(["none", "none", "none", "legacy", "mismatch"]))
    return Scope(
        p_tp=p_tp, d_tp=d_tp, n_layers=n_layers, n_slots=n_slots, indexer=indexer,
        scale=scale, requests=requests,
        layout_mismatch_layer=draw(st.integers(0, n_layers - 1)) if special == "mismatch"
        else None,
        legacy_rank=1 if special == "legacy" and ratio >= 2 else None,
        max_faults=draw(st.integers(0, 3)),
    )


class ClusterMachine(RuleBasedStateMachine):
    """A whole P/D deployment under arbitrary interleavings and faults."""

    prefill_cls: type[PrefillCore] = PrefillCore
    decode_cls: type[DecodeCore] = DecodeCore
    trace: list[str] = []
    first_failure: float | None = None

    @initialize(scope=scopes())
    def deploy(self, scope: Scope) -> None:
        type(self).trace = self.trace = [f"deploy {describe_scope(scope)}"]
        self._guard(lambda: setattr(self, "cluster",
                                    Cluster(scope, self.prefill_cls, self.decode_cls)), "deploy")

    def _guard(self, fn: Callable[[], object], what: str) -> None:
        try:
            out = fn()
        except BaseException as exc:
            self.trace.append(f"{what} raised {type(exc).__name__}: {exc}")
            if type(self).first_failure is None:
                type(self).first_failure = time.perf_counter()
            raise
        if isinstance(out, str):
            self.trace.append(out)

    def _do(self, op: tuple) -> None:
        self._guard(lambda: self.cluster.apply(op), f"{op[0]}{op[1:]}")

    @precondition(lambda self: hasattr(self, "cluster") and self.cluster.progress_pending())
    @rule(data=st.data())
    def progress(self, data: st.DataObject) -> None:
        self._do(data.draw(st.sampled_from(self.cluster.enabled(faults=False)), label="op"))

    @precondition(lambda self: hasattr(self, "cluster") and len(self.cluster.enabled())
                  > len(self.cluster.enabled(faults=False)))
    @rule(data=st.data())
    def fault(self, data: st.DataObject) -> None:
        progress = set(self.cluster.enabled(faults=False))
        faults = [op for op in self.cluster.enabled() if op not in progress]
        self._do(data.draw(st.sampled_from(faults), label="fault"))

    @precondition(lambda self: hasattr(self, "cluster") and not self.cluster.enabled())
    @rule()
    def idle(self) -> None:
        """Everything settled: hypothesis needs a rule to run until the example ends."""

    @invariant()
    def nothing_hangs(self) -> None:
        if hasattr(self, "cluster") and not self.cluster.progress_pending():
            self._guard(self.cluster.check_quiescent, "network drained, no timer pending:")


def describe_scope(s: Scope) -> str:
    reqs = ", ".join(
        f"{t}tok/{'+'.join(map(str, r.chunks))}"
        f"{'' if r.cached_tokens == 0 else ' no-cached-param' if r.cached_tokens is None else f' cached={r.cached_tokens}'}"  # noqa: E501
        f"{' list' if r.group >= 0 else ''}"
        for t, r in ((r.tokens, r) for r in s.requests))
    extra = []
    if s.legacy_rank is not None:
        extra.append(f"P{s.legacy_rank} runs a legacy build")
    if s.layout_mismatch_layer is not None:
        extra.append(f"Decode layout of layer {s.layout_mismatch_layer} differs")
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


def _machine_for(prefill_cls: type[PrefillCore], decode_cls: type[DecodeCore]) -> type:
    return type(f"Check_{prefill_cls.__name__}_{decode_cls.__name__}", (ClusterMachine,),
                {"prefill_cls": prefill_cls, "decode_cls": decode_cls, "trace": [],
                 "first_failure": None})


def run_check(budget: float, seed_value: int = 0, *, prefill_cls: type[PrefillCore] = PrefillCore,
              decode_cls: type[DecodeCore] = DecodeCore, batch: int = 25,
              on_progress: Callable[[float, int], None] | None = None,
              profile: str | None = None) -> CheckResult:
    """Run seeded batches until ``budget`` seconds pass or a counterexample appears."""
    machine = _machine_for(prefill_cls, decode_cls)
    base = settings.get_profile(profile or os.environ.get("SFA_RD2H_PROFILE", "checker"))
    start = time.perf_counter()
    examples = 0
    k = 0
    while True:
        conf = settings(base, max_examples=batch)
        seeded = seed(seed_value * 1_000_003 + k)(machine)
        try:
            run_state_machine_as_test(seeded, settings=conf)
        except BaseException as exc:  # noqa: BLE001 - any escape is a counterexample
            return CheckResult(False, examples + batch, time.perf_counter() - start,
                               (machine.first_failure - start) if machine.first_failure
                               else None, list(machine.trace), f"{type(exc).__name__}: {exc}")
        examples += batch
        k += 1
        elapsed = time.perf_counter() - start
        if on_progress is not None:
            on_progress(elapsed, examples)
        if elapsed >= budget:
            return CheckResult(True, examples, elapsed)


def format_counterexample(result: CheckResult) -> str:
    lines = [f"  {i:>3}. {step}" for i, step in enumerate(result.counterexample, 1)]
    return "\n".join(["counterexample:", *lines, f"  => {result.error.splitlines()[0]}"])
