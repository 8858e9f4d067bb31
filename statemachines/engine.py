"""Runs the declared machines on many models at a runtime cost.

One ``transitions.Machine`` per machine kind is built from the table and serves every model
of that kind: models are never added to it (``add_model`` is linear per call in transitions
0.9.3). ``auto_transitions`` is off so the machine accepts exactly the declared table, and no
``LockedMachine`` is used: each core is driven by one thread.

Triggers run on a compiled form of that same machine: at construction the Driver reads the
built machine's own ``Event`` and ``Transition`` objects into a dict keyed by (state,
trigger), each entry the ordered rows with their guards (name and the value ``transitions``
compares the result with) and effects. Firing is then one dict lookup and direct method
calls, where ``Event.trigger`` builds an ``EventData``, resolves every callback by name and
walks generic callback lists per call (most of the control plane's machine cost). Nothing is
written twice: the rows come from the machine, the machine from the table, and the
compilation refuses a machine that uses a feature it does not execute (prepare or after
callbacks, state enter/exit callbacks, machine-wide callbacks). ``fire_reference`` runs the
``transitions`` engine itself; a test fires both on every (state, trigger, guard outcome).

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


# One compiled row: destination, guards as (method name, expected result), effects.
Row = tuple[str, tuple[tuple[str, bool], ...], tuple[str, ...]]


def compile_machine(machine: Machine) -> dict[tuple[str, str], tuple[Row, ...]]:
    """The rows ``machine`` would try for each (state, trigger), in its order.

    Raises ``ValueError`` if the machine relies on anything beyond conditions, unless and
    before callbacks, so the compiled form can never silently skip a callback."""
    hooks = ("prepare_event", "before_state_change", "after_state_change", "finalize_event",
             "on_exception", "on_final")
    used = [h for h in hooks if getattr(machine, h, None)]
    used += [f"{s.name}.on_enter/on_exit" for s in machine.states.values()
             if s.on_enter or s.on_exit or getattr(s, "on_final", None)]
    rows: dict[tuple[str, str], tuple[Row, ...]] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            out = []
            for t in transitions:
                if t.prepare or t.after:
                    used.append(f"{trigger} from {source}: prepare/after callbacks")
                if t.dest is None or any(not isinstance(c.func, str) for c in t.conditions) \
                        or any(not isinstance(b, str) for b in t.before):
                    used.append(f"{trigger} from {source}: internal or callable callbacks")
                out.append((t.dest, tuple((c.func, c.target) for c in t.conditions),
                            tuple(t.before)))
            rows[(source, trigger)] = tuple(out)
    if used:
        raise ValueError(f"{machine.name}: the compiled driver does not run {sorted(used)}")
    return rows


class Driver:
    """Fires triggers of one machine kind on any number of models."""

    __slots__ = ("spec", "machine", "_events", "_rows", "_valid", "observer")

    def __init__(self, spec: MachineSpec | str, observer: Observer | None = None) -> None:
        self.spec = BY_NAME[spec] if isinstance(spec, str) else spec
        self.machine = build_machine(self.spec)
        self._events = dict(self.machine.events)
        self._rows = compile_machine(self.machine)
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
        return (model.state, trigger) in self._rows

    def _refuse(self, source: str, trigger: str) -> TransitionError:
        detail = "unknown event" if trigger not in self._events else ""
        return TransitionError(self.spec.name, source, trigger, detail)

    def fire(self, model: Any, trigger: str, *args: Any) -> str:
        """Apply ``trigger`` to ``model``; return the new state or raise ``TransitionError``."""
        source = model.state
        rows = self._rows.get((source, trigger))
        if rows is None:
            raise self._refuse(source, trigger)
        for dest, guards, effects in rows:
            # As Condition.check: the guard's result is compared with its target (True
            # for conditions, False for unless), the first miss rejects the row.
            for name, target in guards:
                if not getattr(model, name)(*args) == target:
                    break
            else:
                for name in effects:
                    getattr(model, name)(*args)
                model.state = dest
                break
        else:
            raise TransitionError(self.spec.name, source, trigger, "no guard holds")
        if self.observer is not None:
            self.observer(self.spec.name, model.key, trigger, source, dest, args)
        return dest

    def fire_reference(self, model: Any, trigger: str, *args: Any) -> str:
        """``fire`` through the ``transitions`` engine itself (``Event.trigger``): the
        reference the compiled path is tested against. Same errors, same observer."""
        source = model.state
        if trigger not in self._valid.get(source, ()):
            raise self._refuse(source, trigger)
        try:
            ok = self._events[trigger].trigger(model, *args)
        except MachineError as exc:  # pragma: no cover - _valid mirrors the table
            raise TransitionError(self.spec.name, source, trigger, str(exc)) from None
        if not ok:
            raise TransitionError(self.spec.name, source, trigger, "no guard holds")
        if self.observer is not None:
            self.observer(self.spec.name, model.key, trigger, source, model.state, args)
        return model.state
