"""The Driver's compiled fast path and the ``transitions`` machine it is compiled from agree
on every (machine, state, trigger, guard outcome): same resulting state, same guards asked
in the same order, same effects run with the same arguments, same refusal.

The fast path is not a second copy of the rules: it is read from the built machine's own
objects. This test is what makes that claim checkable.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from transitions import Machine

from sfa_rd2h.spec.errors import TransitionError
from sfa_rd2h.statemachines.engine import Driver, build_machine, compile_machine
from sfa_rd2h.statemachines.tables import MACHINES, MachineSpec

ARGS = ("arg-0", 7)


class Recorder:
    """A model whose guards answer from a table and whose effects only log their calls."""

    def __init__(self, spec: MachineSpec, state: str, outcomes: dict[str, Any],
                 raising: str | None = None) -> None:
        self.key = "m"
        self.state = state
        self.log: list[tuple[Any, ...]] = []
        for name, value in outcomes.items():
            setattr(self, name, self._guard(name, value))
        effects = {e for t in spec.transitions for e in t.before}
        for name in effects:
            setattr(self, name, self._effect(name, name == raising))

    def _guard(self, name: str, value: Any) -> Any:
        def guard(*args: Any) -> Any:
            self.log.append(("guard", name, args))
            return value
        return guard

    def _effect(self, name: str, raises: bool) -> Any:
        def effect(*args: Any) -> None:
            self.log.append(("effect", name, args))
            if raises:
                raise RuntimeError(f"effect {name} failed")
        return effect


def outcome(fire: Any, model: Recorder, trigger: str) -> tuple[Any, ...]:
    try:
        result: Any = fire(model, trigger, *ARGS)
    except (TransitionError, RuntimeError) as exc:
        result = (type(exc).__name__, str(exc))
    return result, model.state, model.log


def cases() -> list[tuple[MachineSpec, str, str, dict[str, Any], str | None]]:
    out = []
    for spec in MACHINES:
        guards = sorted({g for t in spec.transitions for g in t.conditions + t.unless})
        for state, trigger in itertools.product(spec.state_names, spec.triggers):
            rows = [t for t in spec.transitions if t.source == state and t.trigger == trigger]
            mine = sorted({g for t in rows for g in t.conditions + t.unless})
            effects = sorted({e for t in rows for e in t.before})
            # every guard outcome of the rows tried here; guards of other rows answer True
            for values in itertools.product((True, False), repeat=len(mine)):
                table = dict.fromkeys(guards, True) | dict(zip(mine, values, strict=True))
                out.append((spec, state, trigger, table, None))
                for effect in effects:  # an effect that raises leaves the state unchanged
                    out.append((spec, state, trigger, table, effect))
    return out


CASES = cases()


def test_every_state_trigger_and_outcome_is_covered() -> None:
    for spec in MACHINES:
        seen = {(s, t) for sp, s, t, _, _ in CASES if sp is spec}
        assert seen == set(itertools.product(spec.state_names, spec.triggers))
    assert len(CASES) > 100


@pytest.mark.parametrize("spec,state,trigger,outcomes,raising", CASES,
                         ids=[f"{c[0].name}-{c[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_compiled_path_agrees_with_transitions(spec: MachineSpec, state: str, trigger: str,
                                               outcomes: dict[str, Any],
                                               raising: str | None) -> None:
    driver = Driver(spec)
    fast = outcome(driver.fire, Recorder(spec, state, outcomes, raising), trigger)
    reference = outcome(driver.fire_reference, Recorder(spec, state, outcomes, raising),
                        trigger)
    assert fast == reference


def test_non_bool_guard_results_compare_like_transitions() -> None:
    # transitions compares a guard's result with True/False (==): 1 passes, a set does not.
    spec = next(m for m in MACHINES if m.name == "prefill_slot")
    for value in (1, 0, {"x"}, None, "yes"):
        table = {"no_readers": value}
        driver = Driver(spec)
        fast = outcome(driver.fire, Recorder(spec, "landed", table), "publish")
        ref = outcome(driver.fire_reference, Recorder(spec, "landed", table), "publish")
        assert fast == ref, value


def test_unknown_trigger_is_refused_alike() -> None:
    spec = MACHINES[0]
    driver = Driver(spec)
    assert outcome(driver.fire, Recorder(spec, "free", {}), "nope") == \
        outcome(driver.fire_reference, Recorder(spec, "free", {}), "nope")


def test_compilation_refuses_callbacks_it_would_not_run() -> None:
    machine = build_machine(MACHINES[0])
    machine.events["begin_write"].transitions["free"][0].after.append("take_owner")
    with pytest.raises(ValueError, match="prepare/after"):
        compile_machine(machine)
    machine = build_machine(MACHINES[0], Machine, after_state_change="take_owner")
    with pytest.raises(ValueError, match="after_state_change"):
        compile_machine(machine)
