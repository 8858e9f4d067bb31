"""Runs the declared machines on many models at a runtime cost.

One ``transitions.Machine`` per machine kind serves every model of that kind: models are
never added to it (``add_model`` is linear per call in transitions 0.9.3), triggers are
dispatched with ``machine.events[name].trigger(model, *args)``. ``auto_transitions`` is
off so the machine accepts exactly the declared table, and no ``LockedMachine`` is used:
each core is driven by one thread.

An event the table does not allow raises ``TransitionError`` naming machine, state and
event; the model's state is unchanged, because guards are evaluated before any effect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transitions import Machine, MachineError, State

from sfa_rd2h.spec.errors import TransitionError
from sfa_rd2h.statemachines.tables import BY_NAME, MachineSpec, StateSpec

# observer(machine, key, event, source, dest, args)
Observer = Callable[[str, str, str, str, str, tuple], None]


def build_machine(
    spec: MachineSpec, machine_cls: type[Machine] = Machine,
    state_kwargs: Callable[[StateSpec], dict[str, Any]] | None = None, **kwargs: Any
) -> Machine:
    """A ``transitions`` machine for ``spec`` with no models attached."""
    state_cls = getattr(machine_cls, "state_cls", State)
    states = [state_cls(s.name, final=s.final, **state_kwargs(s)) if state_kwargs else
              State(s.name, final=s.final) for s in spec.states]
    table = [
        {
            "trigger": t.trigger,
            "source": t.source,
            "dest": t.dest,
            "conditions": list(t.conditions),
            "unless": list(t.unless),
            "before": list(t.before),
        }
        for t in spec.transitions
    ]
    return machine_cls(
        model=None,
        states=states,
        transitions=table,
        initial=spec.initial,
        auto_transitions=False,
        send_event=False,
        name=spec.name,
        **kwargs,
    )


class Driver:
    """Fires triggers of one machine kind on any number of models."""

    __slots__ = ("spec", "machine", "_events", "_valid", "observer")

    def __init__(self, spec: MachineSpec | str, observer: Observer | None = None) -> None:
        self.spec = BY_NAME[spec] if isinstance(spec, str) else spec
        self.machine = build_machine(self.spec)
        self._events = dict(self.machine.events)
        self._valid = {
            state: frozenset(t.trigger for t in self.spec.transitions if t.source == state)
            for state in self.spec.state_names
        }
        self.observer = observer

    def __deepcopy__(self, memo: dict) -> Driver:
        # A driver holds no per-model state: copies of a core (the explorer clones whole
        # clusters) share it instead of rebuilding a transitions.Machine each time.
        return self

    def start(self, model: Any) -> Any:
        """Put a fresh model in the initial state and return it."""
        model.state = self.spec.initial
        if self.observer is not None:
            self.observer(self.spec.name, model.key, "start", "", model.state, ())
        return model

    def allowed(self, state: str) -> frozenset[str]:
        return self._valid[state]

    def can(self, model: Any, trigger: str) -> bool:
        """Whether ``trigger`` is declared from the model's state (guards not evaluated)."""
        return trigger in self._valid[model.state]

    def fire(self, model: Any, trigger: str, *args: Any) -> str:
        """Apply ``trigger`` to ``model``; return the new state or raise ``TransitionError``."""
        source = model.state
        if trigger not in self._valid.get(source, ()):
            detail = "unknown event" if trigger not in self._events else ""
            raise TransitionError(self.spec.name, source, trigger, detail)
        try:
            ok = self._events[trigger].trigger(model, *args)
        except MachineError as exc:  # pragma: no cover - _valid mirrors the table
            raise TransitionError(self.spec.name, source, trigger, str(exc)) from None
        if not ok:
            raise TransitionError(self.spec.name, source, trigger, "no guard holds")
        if self.observer is not None:
            self.observer(self.spec.name, model.key, trigger, source, model.state, args)
        return model.state
