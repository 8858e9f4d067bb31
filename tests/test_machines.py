"""The declared machines: concrete lifecycles and totality over every (state, trigger)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfa_rd2h.spec.errors import ProtocolError, TransitionError
from sfa_rd2h.statemachines.engine import Driver
from sfa_rd2h.statemachines.models import (
    MODEL_CLASSES,
    LayerRead,
    PeerSession,
    ReadFailed,
    RequestStatus,
    SlotGate,
)
from sfa_rd2h.statemachines.tables import BY_NAME, MACHINES

ENDPOINTS = ("d0", "d1", "d2")


def test_tables_are_well_formed():
    assert [m.name for m in MACHINES] == [
        "prefill_slot", "decode_layer_read", "request_status", "peer_session"]
    assert BY_NAME["decode_layer_read"].final_states == {"done", "failed"}
    assert BY_NAME["request_status"].final_states == {"succeeded", "failed"}
    for m in MACHINES:
        assert m.model in MODEL_CLASSES
        for t in m.transitions:
            assert t.rules, f"{m.name}.{t.trigger} cites no rule"
            model_cls = MODEL_CLASSES[m.model]
            for name in t.conditions + t.unless + t.before:
                assert callable(getattr(model_cls, name)), f"{m.model}.{name} missing"


def test_slot_waits_for_every_reader_once():  # S1, S3, S5
    d = Driver("prefill_slot")
    g = d.start(SlotGate("main@4096"))
    d.fire(g, "begin_write", 0)
    with pytest.raises(TransitionError, match="publish.*writing"):  # C4: not landed yet
        d.fire(g, "publish", frozenset({"d0"}))
    d.fire(g, "scatter_landed")
    d.fire(g, "publish", frozenset({"d0", "d1"}))
    assert g.state == "awaiting_replies" and g.publication == 1
    d.fire(g, "reply_done", "d0")
    with pytest.raises(TransitionError, match="no guard holds") as err:  # duplicate reply
        d.fire(g, "reply_done", "d0")
    assert err.value.machine == "prefill_slot" and err.value.state == "awaiting_replies"
    assert g.state == "awaiting_replies" and g.pending == {"d1"}
    with pytest.raises(TransitionError):  # S1: no overwrite while d1 reads
        d.fire(g, "begin_write", 3)
    d.fire(g, "reply_done", "d1")
    assert g.state == "free" and g.owner is None


def test_slot_failure_is_held_until_observed():  # S4
    d = Driver("prefill_slot")
    g = d.start(SlotGate("idx@0"))
    for trig, args in (("begin_write", (2,)), ("scatter_landed", ()),
                       ("publish", (frozenset({"d0", "d1"}),))):
        d.fire(g, trig, *args)
    d.fire(g, "reply_failed", "d0", "F2: batched read returned -1")
    assert g.state == "awaiting_replies"
    d.fire(g, "reply_done", "d1")
    assert g.state == "failed" and "layer 2 via d0" in g.error
    d.fire(g, "observe_error")
    assert g.state == "free" and g.error is None


def test_slot_without_readers_is_free_after_publish():  # S3
    d = Driver("prefill_slot")
    g = d.start(SlotGate("main@0"))
    d.fire(g, "begin_write", 1)
    d.fire(g, "scatter_landed")
    assert d.fire(g, "publish", frozenset()) == "free"


def test_request_counts_each_contributor_once():  # R1, R4
    d = Driver("request_status")
    r = d.start(RequestStatus("req-1"))
    d.fire(r, "contributor_final", 0, 2)
    d.fire(r, "contributor_final", 0, 2)  # R4: a duplicate does not advance
    assert r.state == "registered" and r.finals == {0}
    d.fire(r, "contributor_final", 1, 2)
    assert r.state == "local_ok"
    d.fire(r, "contributor_final", 1, 2)  # a later final changes nothing
    assert r.state == "local_ok"
    # a read issued before the last final fails after it: not yet reported, it fails (R5)
    d.fire(r, "read_failed", "late")
    assert r.state == "local_failed" and r.error == "late"
    d.fire(r, "tp_agreed", False)
    assert r.state == "failed"
    with pytest.raises(TransitionError, match="final|not allowed"):
        d.fire(r, "tp_agreed", True)


def test_request_detects_changed_ratio():  # R1, T1 (known failure 3)
    d = Driver("request_status")
    r = d.start(RequestStatus("req-2"))
    d.fire(r, "contributor_final", 0, 2)
    d.fire(r, "contributor_final", 1, 4)
    assert r.state == "local_failed" and "tp_ratio=4" in r.error
    d.fire(r, "tp_agreed", True)
    assert r.state == "failed"


def test_layer_read_paths():  # S3, C1, F2
    d = Driver("decode_layer_read")
    empty = d.start(LayerRead("c/0", 0))
    assert d.fire(empty, "accept") == "done"  # T4: zero blocks still replies
    waiting = d.start(LayerRead("c/1", 1, missing=frozenset({"r"})))
    assert d.fire(waiting, "accept") == "awaiting_destinations"
    # the missing requests fail on their own (R5); the READY is served for the others
    assert d.fire(waiting, "wait_expired") == "received"
    reading = d.start(LayerRead("c/2", 2, n_reads=3))
    d.fire(reading, "accept")
    assert d.fire(reading, "read_completed", -5, 0.0) == "failed"
    assert reading.error == "F2: batched read returned -5"
    told = d.start(LayerRead("c/3", 3, n_reads=1))
    d.fire(told, "accept")  # the runtime knew why: the engine's words travel with the code
    assert d.fire(told, "read_completed", ReadFailed(-5, "PEER_GONE: serves readers on this "
                                                         "host only"), 0.0) == "failed"
    assert told.error == "F2: batched read returned -5: PEER_GONE: serves readers on this " \
                         "host only"


def test_a_read_past_its_budget_fails_even_when_the_engine_says_ok():  # S6, S5
    d = Driver("decode_layer_read")
    on_time = d.start(LayerRead("c/0", 0, n_reads=1, received_at=100.0, read_budget=30.0))
    d.fire(on_time, "accept")
    assert d.fire(on_time, "read_completed", 0, 130.0) == "done"  # the budget is inclusive
    late = d.start(LayerRead("c/1", 1, n_reads=1, received_at=100.0, read_budget=30.0))
    d.fire(late, "accept")
    assert d.fire(late, "read_completed", 0, 130.5) == "failed"
    assert late.error.startswith("S6: the read finished 30.5s after its READY arrived")
    broken = d.start(LayerRead("c/2", 2, n_reads=1, received_at=100.0, read_budget=30.0))
    d.fire(broken, "accept")
    assert d.fire(broken, "read_completed", -1, 200.0) == "failed"
    assert broken.error == "F2: batched read returned -1"  # the engine's failure is named


def test_peer_session_restarts_handshake():  # W1, F3, S5
    d = Driver("peer_session")
    s = d.start(PeerSession("d0"))
    with pytest.raises(TransitionError):
        d.fire(s, "meta_acked")
    d.fire(s, "connect")
    d.fire(s, "meta_acked")
    d.fire(s, "peer_lost")
    assert s.state == "disconnected"
    d.fire(s, "connect")
    d.fire(s, "meta_refused", "F3: protocol version 2 from prefill, decode speaks 1")
    assert s.state == "refused"


def test_unknown_event_names_machine_state_and_event():
    d = Driver("peer_session")
    s = d.start(PeerSession("d0"))
    with pytest.raises(ProtocolError, match=r"peer_session: event 'explode' .* 'disconnected'"):
        d.fire(s, "explode")


def test_observer_sees_every_transition():
    seen = []
    d = Driver("peer_session", observer=lambda *a: seen.append(a[:5]))
    s = d.start(PeerSession("d0"))
    d.fire(s, "connect")
    assert seen == [("peer_session", "d0", "start", "", "disconnected"),
                    ("peer_session", "d0", "connect", "disconnected", "handshaking")]


# Totality: every (state, trigger) pair either takes a declared transition or raises a
# ProtocolError with the state unchanged, for arbitrary trigger arguments.
ARGS = {
    "begin_write": st.tuples(st.integers(0, 8)),
    "scatter_landed": st.just(()),
    "publish": st.tuples(st.frozensets(st.sampled_from(ENDPOINTS))),
    "reply_done": st.tuples(st.sampled_from(ENDPOINTS)),
    "reply_failed": st.tuples(st.sampled_from(ENDPOINTS), st.text(max_size=5)),
    "reader_lost": st.tuples(st.sampled_from(ENDPOINTS), st.text(max_size=5)),
    "observe_error": st.just(()),
    "reject": st.tuples(st.text(max_size=5)),
    "accept": st.just(()),
    "destinations_arrived": st.just(()),
    "wait_expired": st.tuples(st.text(max_size=5)),
    "read_completed": st.tuples(st.integers(-3, 3), st.floats(0, 100)),
    "contributor_final": st.tuples(st.integers(0, 4), st.integers(1, 4)),
    "read_failed": st.tuples(st.text(max_size=5)),
    "ratio_conflict": st.tuples(st.text(max_size=5)),
    "deadline_expired": st.tuples(st.text(max_size=5)),
    "tp_agreed": st.tuples(st.booleans()),
    "connect": st.just(()),
    "meta_acked": st.just(()),
    "meta_refused": st.tuples(st.text(max_size=5)),
    "peer_lost": st.just(()),
}


def _model(machine_name: str, data: st.DataObject):
    spec = BY_NAME[machine_name]
    cls = MODEL_CLASSES[spec.model]
    if cls is SlotGate:
        return SlotGate("g", owner=data.draw(st.none() | st.integers(0, 8)),
                        pending=set(data.draw(st.frozensets(st.sampled_from(ENDPOINTS)))),
                        error=data.draw(st.none() | st.just("e")))
    if cls is LayerRead:
        return LayerRead("r", 0, missing=data.draw(st.frozensets(st.just("x"))),
                         n_reads=data.draw(st.integers(0, 2)))
    if cls is RequestStatus:
        return RequestStatus("q", ratio=data.draw(st.none() | st.integers(1, 4)),
                             finals=set(data.draw(st.frozensets(st.integers(0, 3)))))
    return cls("s")


def test_every_trigger_has_argument_strategy():
    assert {t for m in MACHINES for t in m.triggers} <= set(ARGS)


@pytest.mark.parametrize("machine_name", [m.name for m in MACHINES])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_totality(machine_name, data):
    spec = BY_NAME[machine_name]
    driver = Driver(spec)
    model = _model(machine_name, data)
    model.state = data.draw(st.sampled_from(spec.state_names))
    trigger = data.draw(st.sampled_from(sorted(set(ARGS))))
    args = data.draw(ARGS[trigger])
    before = model.state
    declared = {t.dest for t in spec.transitions if t.source == before and t.trigger == trigger}
    try:
        after = driver.fire(model, trigger, *args)
    except ProtocolError as exc:
        assert model.state == before
        assert machine_name in str(exc) and repr(trigger) in str(exc)
    else:
        assert after in declared
        assert before not in spec.final_states
