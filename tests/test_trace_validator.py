"""The trace validator's machine and cross-process rules, one planted defect each (issue 12):
what ``sfa-rd2h validate`` must call a divergence in traces written by real processes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import msgpack
import pytest

from sfa_rd2h.spec import wire
from sfa_rd2h.statemachines.trace import Tracer, summarize, validate


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
    assert (d.path, d.line, d.rule) == (str(tmp_path / "x.jsonl"), 2, "machines")
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
    assert (d.path, d.line, d.rule) == (str(tmp_path / "d.jsonl"), 4, "machines")
    assert d.message == "request_status[r] started twice"
    # The same key in another machine is another instance.
    t = Tracer(tmp_path / "ok.jsonl", "ok", role="decode")
    t("request_status", "k", "start", "", "registered", ())
    t("decode_layer_read", "k", "start", "", "received", ())
    t.close()
    assert validate([tmp_path / "ok.jsonl"]).ok


# --------------------------------------------------------------------------- hand-written traces


def _trace(path: Path, role: str, records: list[dict], *, closed: bool = True,
           **info: object) -> Path:
    """A trace file as a process would leave it: header, ``records``, close marker."""
    lines = [{"k": "process", "name": path.stem, "pid": 1, "role": role, **info}, *records]
    if closed:
        lines.append({"k": "close", "t": 9.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _msg(direction: str, peer: str | None, kind: str, layer: int | None = None,
         conn: str | None = None) -> dict:
    rec: dict = {"k": "msg", "t": 0.0, "dir": direction, "kind": kind}
    if peer is not None:
        rec["peer"] = peer
    if layer is not None:
        rec["layer"] = layer
    if conn is not None:
        rec["conn"] = conn
    return rec


def _read(key: str, *path: str) -> list[dict]:
    """decode_layer_read ``key`` started and taken along ``path`` (accept, ...)."""
    recs = [{"k": "tr", "t": 0.0, "m": "decode_layer_read", "key": key, "ev": "start",
             "src": "", "dst": "received"}]
    state = "received"
    for step in path:
        ev, dst = step.split(">")
        recs.append({"k": "tr", "t": 0.0, "m": "decode_layer_read", "key": key, "ev": ev,
                     "src": state, "dst": dst})
        state = dst
    return recs


def _where(report) -> list[tuple[str, int, str, str]]:
    return [(Path(d.path).name, d.line, d.rule, d.message) for d in report.divergences]


def test_the_tracer_writes_each_record_kind_with_its_fields(tmp_path: Path) -> None:
    """What ``sfa-rd2h validate`` and a reader rely on: every record carries its time,
    transition arguments keep JSON scalars and cut long texts, ``conn`` records name the
    peer."""
    path = tmp_path / "p.jsonl"
    t = Tracer(path, "p", role="prefill", rank=3)
    t("prefill_slot", "s", "start", "", "free", (None, True, 7, 2.5, "x" * 500,
                                                 {"b", "a"}, ("c",), object))
    t.connection("open", "d0:7000", "c1")
    t.info(endpoint="d0:7000")
    t.close()
    head, tr, conn, info, close = (json.loads(line) for line in path.read_text().splitlines())
    t0 = head.pop("t0")
    assert head == {"k": "process", "name": "p", "pid": os.getpid(), "role": "prefill",
                    "rank": 3}
    # the origin is on the host-wide monotonic clock: other processes' times align with it
    assert t0 <= time.monotonic() and t0 + tr["t"] <= time.monotonic()
    assert tr["a"] == [None, True, 7, 2.5, "x" * 160, ["a", "b"], ["c"], str(object)]
    assert set(tr) == {"k", "t", "m", "key", "ev", "src", "dst", "a"}
    assert set(conn) == {"k", "t", "ev", "peer", "conn"}
    assert (conn["ev"], conn["peer"], conn["conn"]) == ("open", "d0:7000", "c1")
    assert set(info) == {"k", "t", "endpoint"} and set(close) == {"k", "t"}
    assert all(isinstance(r["t"], float) for r in (tr, conn, info, close))


def test_an_abandoned_trace_stays_unclosed_and_takes_no_more_records(tmp_path: Path) -> None:
    """What a killed process leaves: no close marker; the Tracer ignores later calls
    (a later ``close`` neither raises nor appends)."""
    path = tmp_path / "d.jsonl"
    t = Tracer(path, "d", role="decode")
    t.info(x=1)
    t.abandon()
    t.info(x=2)
    t.close()
    t.abandon()
    assert [json.loads(line)["k"] for line in path.read_text().splitlines()] == [
        "process", "info"]
    report = validate([path])
    assert report.ok and report.unclosed == [str(path)]


def test_summary_names_the_first_divergence_and_counts_the_rest(tmp_path: Path) -> None:
    ok = _trace(tmp_path / "ok.jsonl", "decode", [])
    assert validate([ok]).summary() == "valid: 1 trace(s), 2 records, 0 transitions, " \
                                       "0 messages"
    open_ = _trace(tmp_path / "open.jsonl", "decode", [], closed=False)
    assert validate([open_]).summary().endswith(f"; not closed cleanly: [{str(open_)!r}]")
    one = _trace(tmp_path / "one.jsonl", "decode", [{"k": "what"}])
    text = validate([one]).summary()
    assert text == (f"DIVERGENCE: {one}:2: trace: unknown record kind 'what'\n"
                    "  in 1 trace(s), 3 records, 0 transitions, 0 messages")
    three = _trace(tmp_path / "three.jsonl", "decode", [{"k": "what"}] * 3)
    assert validate([three]).summary().startswith(
        f"DIVERGENCE: {three}:2: trace: unknown record kind 'what' (+2 more)\n")


def test_at_most_100_divergences_are_kept(tmp_path: Path) -> None:
    bad = _trace(tmp_path / "bad.jsonl", "decode", [{"k": "what"}] * 150)
    report = validate([bad])
    assert len(report.divergences) == 100 and report.records == 152
    assert report.divergences[-1].line == 101


def test_readys_before_mf_meta_may_only_be_refused_each_once(tmp_path: Path) -> None:
    """W1 on Decode: every READY that came before MF_META is answered READ_FAILED; once
    MF_META is in, READ_DONE is fine again."""
    good = _trace(tmp_path / "good.jsonl", "decode", [
        _msg("recv", "p", "read_ready_batch", 0),
        _msg("send", "p", "read_failed", 0),
        _msg("recv", "p", "mf_meta"),
        _msg("recv", "p", "read_ready_batch", 0),
        _msg("recv", "p", "read_ready_batch", 0),
        _msg("send", "p", "read_done", 0),
        _msg("send", "p", "read_done", 0),
    ])
    assert validate([good]).ok, validate([good]).summary()
    bad = _trace(tmp_path / "bad.jsonl", "decode", [
        _msg("recv", "p", "read_ready_batch", 0),
        _msg("recv", "p", "read_ready_batch", 0),
        _msg("send", "p", "read_failed", 0),
        _msg("recv", "p", "mf_meta"),
        _msg("send", "p", "read_done", 0),
    ])
    assert _where(validate([bad])) == [
        ("bad.jsonl", 6, "W1", "read_done for layer 0 on connection p answers a READY "
                               "that came before MF_META; only READ_FAILED may")]
    early = _trace(tmp_path / "early.jsonl", "prefill", [
        _msg("send", "d0:7000", "read_ready_batch", 2, conn="c1"),
        _msg("recv", "d0:7000", "read_failed", 2, conn="c1"),
    ])
    assert _where(validate([early])) == [
        ("early.jsonl", 2, "W1", "READY for layer 2 on connection c1 before MF_META")]


def test_a_reply_without_an_outstanding_ready_is_an_s3_divergence(tmp_path: Path) -> None:
    """S3: the message names the connection (a record without a peer is connection '')."""
    bad = _trace(tmp_path / "bad.jsonl", "decode", [
        _msg("recv", None, "mf_meta"),
        _msg("send", None, "read_done", 4),
    ])
    assert _where(validate([bad])) == [
        ("bad.jsonl", 3, "S3", "read_done for layer 4 on connection  answers no "
                               "outstanding READY")]


def test_unanswered_readys_at_close_point_at_the_connection_last_line(tmp_path: Path) -> None:
    """S3 at the end of a cleanly closed trace: the divergence points at the last record
    of the connection; a connection Prefill saw ``lost`` is not judged (S5), one it only
    saw ``open`` is."""
    recs = [
        {"k": "conn", "t": 0.0, "ev": "open", "peer": "d0:7000", "conn": "c1"},
        _msg("send", "d0:7000", "mf_meta", conn="c1"),
        _msg("send", "d0:7000", "read_ready_batch", 0, conn="c1"),
        _msg("send", "d0:7000", "read_ready_batch", 1, conn="c1"),
        _msg("recv", "d0:7000", "read_done", 0, conn="c1"),
        {"k": "info", "t": 0.0, "note": "unrelated"},
    ]
    p = _trace(tmp_path / "p.jsonl", "prefill", recs)
    assert _where(validate([p])) == [
        ("p.jsonl", 6, "S3", "connection c1 closed with unanswered READY(s) per layer {1: 1}")]
    lost = {"k": "conn", "t": 0.0, "ev": "lost", "peer": "d0:7000", "conn": "c1"}
    assert validate([_trace(tmp_path / "lost.jsonl", "prefill", [*recs, lost])]).ok
    # a lost connection does not excuse the next one
    lost0 = {"k": "conn", "t": 0.0, "ev": "lost", "peer": "d0:7000", "conn": "c0"}
    assert [d.line for d in validate([_trace(tmp_path / "two.jsonl", "prefill",
                                             [lost0, *recs])]).divergences] == [7]
    # a connection seen once is reported at that line
    once = _trace(tmp_path / "once.jsonl", "prefill", [recs[2]])
    assert [(d.line, d.rule) for d in validate([once]).divergences] == [(2, "W1"), (2, "S3")]
    # the conn record alone makes the connection: its line is the one reported
    only = _trace(tmp_path / "only.jsonl", "prefill", [recs[0]])
    assert validate([only]).ok
    first = _trace(tmp_path / "first.jsonl", "prefill", [recs[2], recs[0]])
    assert [d.line for d in validate([first]).divergences] == [2, 3]  # W1, then S3


def test_both_ends_of_a_connection_must_count_the_same_frames(tmp_path: Path) -> None:
    """S3 across files: Prefill's connection is paired with the Decode trace whose endpoint
    its ``conn`` record names; READYs sent must be READYs received and replies likewise."""
    def prefill(name: str, replies: int) -> Path:
        return _trace(tmp_path / name, "prefill", [
            {"k": "conn", "t": 0.0, "ev": "open", "peer": "d0:7000", "conn": "c1"},
            _msg("send", "d0:7000", "mf_meta", conn="c1"),
            _msg("send", "d0:7000", "read_ready_batch", 0, conn="c1"),
            _msg("send", "d0:7000", "read_ready_batch", 0, conn="c1"),
            *[_msg("recv", "d0:7000", "read_done", 0, conn="c1")] * replies,
        ])

    def decode(name: str, replies: int) -> Path:
        return _trace(tmp_path / name, "decode", [
            {"k": "info", "t": 0.0, "endpoint": "d0:7000"},
            _msg("recv", "c1", "mf_meta"),
            _msg("recv", "c1", "read_ready_batch", 0),
            _msg("recv", "c1", "read_ready_batch", 0),
            *[_msg("send", "c1", "read_done", 0)] * replies,
        ], closed=replies == 2)

    d2 = decode("d2.jsonl", 2)
    assert validate([prefill("p2.jsonl", 2), d2]).ok
    # Decode sent two replies, Prefill says it received one (and closed with one open)
    got = _where(validate([prefill("p1.jsonl", 1), d2]))
    assert ("p1.jsonl", 6, "S3", f"connection c1: {d2} sent replies per layer {{0: 2}}, "
                                 "Prefill received {0: 1}") in got
    # a Decode that did not close cleanly is not compared
    assert validate([prefill("p2b.jsonl", 2), decode("d1.jsonl", 1)]).divergences == []


def test_only_replies_decode_sends_are_matched_to_its_reads(tmp_path: Path) -> None:
    """W3/F2 compares the replies Decode sends with the reads that ended; a READY that
    arrives in between, or a read key that names no layer, is not a reply to judge."""
    ok = _trace(tmp_path / "ok.jsonl", "decode", [
        _msg("recv", "tcp://h:1", "mf_meta"),
        _msg("recv", "tcp://h:1", "read_ready_batch", 0),
        *_read("tcp://h:1/L0/0", "accept>reading", "read_completed>done"),
        _msg("recv", "tcp://h:1", "read_ready_batch", 0),
        _msg("send", "tcp://h:1", "read_ready_batch", 0),
        _msg("send", "tcp://h:1", "read_done", 0),
        _msg("send", "tcp://h:1", "read_done", 0),
    ])
    assert validate([ok]).ok, validate([ok]).summary()
    # a peer with slashes in its name: the layer is the second-to-last part of the key
    bad = _trace(tmp_path / "bad.jsonl", "decode", [
        _msg("recv", "tcp://h:1", "mf_meta"),
        _msg("recv", "tcp://h:1", "read_ready_batch", 0),
        *_read("tcp://h:1/L0/0", "accept>reading", "read_completed>done"),
        _msg("send", "tcp://h:1", "read_failed", 0),
    ])
    assert _where(validate([bad])) == [
        ("bad.jsonl", 7, "W3", "read_failed for layer 0 to tcp://h:1 answers "
                               "decode_layer_read[tcp://h:1/L0/0], which ended 'done' at "
                               "line 6; it calls for read_done")]
    odd = _trace(tmp_path / "odd.jsonl", "decode", [
        _msg("recv", "p", "mf_meta"),
        _msg("recv", "p", "read_ready_batch", 0),
        *_read("p/M0/0", "reject>failed"),
        _msg("send", "p", "read_done", 0),
    ])
    assert validate([odd]).ok


def _tr(machine: str, key: str, ev: str, src: str, dst: str) -> dict:
    return {"k": "tr", "t": 0.0, "m": machine, "key": key, "ev": ev, "src": src, "dst": dst}


@pytest.mark.parametrize(("records", "expected"), [
    ([_tr("nope", "k", "start", "", "x")], [(2, "unknown machine 'nope'")]),
    ([_tr("decode_layer_read", "k", "accept", "received", "reading"),
      _tr("decode_layer_read", "k", "read_completed", "reading", "done")],
     [(2, "decode_layer_read[k]: 'accept' before its start record")]),
    (_read("k") + [_tr("decode_layer_read", "k", "accept", "reading", "done")],
     [(3, "decode_layer_read[k]: record says 'accept' from 'reading', replay is in "
          "'received'")]),
    (_read("k", "reject>failed") + [_tr("decode_layer_read", "k", "accept", "failed", "done")],
     [(4, "decode_layer_read[k]: 'accept' leaves final state 'failed'")]),
    (_read("k") + [_tr("decode_layer_read", "k", "read_completed", "received", "done")],
     [(3, "decode_layer_read[k]: 'read_completed' is not declared from 'received'")]),
    (_read("k") + [_tr("decode_layer_read", "k", "accept", "received", "failed")],
     [(3, "decode_layer_read[k]: 'accept' from 'received' goes to ['awaiting_destinations', "
          "'done', 'reading'], record says 'failed'")]),
])
def test_each_undeclared_transition_is_named_where_it_happens(
        tmp_path: Path, records: list[dict], expected: list[tuple[int, str]]) -> None:
    """The machines rule: a transition the tables do not declare is reported at its line,
    and the replay goes on from the state the record claims."""
    path = _trace(tmp_path / "d.jsonl", "decode", records)
    assert _where(validate([path])) == [("d.jsonl", line, "machines", message)
                                        for line, message in expected]


def test_malformed_trace_lines_are_named_and_the_rest_is_still_read(tmp_path: Path) -> None:
    """A bad line is one divergence at its line; blank lines are skipped; what is readable
    is still counted and checked."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join([
        b'{"k": "info"}',  # 1: not the header
        b"",  # blank: skipped
        b"   ",
        b"[1]",  # 4
        b"\xff\xfe",  # 5
        b"{nope",  # 6
        b'{"k": 5}',  # 7
        b'{"k": "msg", "layer": "3"}',  # 8
        b'{"k": "what"}',  # 9
        b'{"k": "msg", "dir": "recv", "peer": "p", "kind": "mf_meta"}',  # 10
        json.dumps(_tr("decode_layer_read", "k", "start", "", "received")).encode(),  # 11
    ]) + b"\n")
    report = validate([path])
    assert _where(report) == [
        ("bad.jsonl", 1, "trace", "first record is not a process header"),
        ("bad.jsonl", 4, "trace", "record is not a JSON object"),
        ("bad.jsonl", 5, "trace", "not a JSON record: not UTF-8 text"),
        ("bad.jsonl", 6, "trace", "not a JSON record: Expecting property name enclosed in "
                                  "double quotes: line 1 column 2 (char 1)"),
        ("bad.jsonl", 7, "trace", "field 'k' must be a string, got int"),
        ("bad.jsonl", 8, "trace", "field 'layer' must be an integer, got str"),
        ("bad.jsonl", 9, "trace", "unknown record kind 'what'"),
    ]
    assert (report.files, report.records, report.transitions, report.messages) == (1, 6, 1, 1)
    assert report.unclosed == [str(path)]


def test_an_unreadable_or_empty_trace_is_a_divergence(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    report = validate([missing, empty])
    assert _where(report) == [
        ("missing.jsonl", 0, "trace",
         f"cannot read: [Errno 2] No such file or directory: {str(missing)!r}"),
        ("empty.jsonl", 0, "trace", "empty: the process never flushed its trace"),
    ]
    assert report.files == 2


def test_the_decode_endpoint_may_come_in_the_header(tmp_path: Path) -> None:
    """Pairing for the S3 cross-check finds a Decode by the endpoint of its header too
    (an ``info`` record without one leaves it)."""
    p = _trace(tmp_path / "p.jsonl", "prefill", [
        {"k": "conn", "t": 0.0, "ev": "open", "peer": "d0:7000", "conn": "c1"},
        _msg("send", "d0:7000", "mf_meta", conn="c1"),
    ])
    d = _trace(tmp_path / "d.jsonl", "decode", [
        {"k": "info", "t": 0.0, "rank": 0},
        _msg("recv", "c1", "mf_meta"),
        _msg("recv", "c1", "read_ready_batch", 0),
        _msg("send", "c1", "read_done", 0),
    ], endpoint="d0:7000")
    assert _where(validate([p, d])) == [
        ("p.jsonl", 3, "S3", f"connection c1: Prefill sent READYs per layer {{}}, {d} "
                             "received {0: 1}")]


def test_the_tracer_buffers_transitions_and_flushes_frames_in_blocks(tmp_path: Path) -> None:
    """Transitions come under the worker's lock, so they only ever go to the buffer; a
    frame or info record finds it full at 512 lines and writes it; ``close`` writes the
    rest, once. Times are seconds since the tracer started, to the microsecond."""
    path = tmp_path / "deep" / "er" / "d.jsonl"  # folders are made
    before = time.monotonic()
    t = Tracer(path, "d", role="decode")
    assert (t.path, t.process_name) == (path, "d")
    for i in range(600):
        t("request_status", f"r{i}", "start", "", "registered", ())
    assert path.read_text() == ""  # nothing written under the lock
    t.info(n=1)
    assert len(path.read_text().splitlines()) == 602
    for i in range(511):
        t.info(n=i, where=tmp_path)  # values JSON cannot hold are written as text
    assert len(path.read_text().splitlines()) == 602  # 511 buffered
    t.info(n=511)
    assert len(path.read_text().splitlines()) == 602 + 512  # full: written
    t.message("recv", "p", b"ACK")
    t.close()
    t.close()  # idempotent
    t.info(n=-1)  # ignored after close
    after = time.monotonic()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 602 + 512 + 2
    assert [r["k"] for r in records[-3:]] == ["info", "msg", "close"]
    assert records[-4]["where"] == str(tmp_path)
    assert records[-2] == {"k": "msg", "t": records[-2]["t"], "dir": "recv", "peer": "p",
                           "kind": "ack"}
    times = [r["t"] for r in records[1:]]
    assert all(0 <= x <= after - before and x == round(x, 6) for x in times)


def test_cross_checks_pair_every_connection_and_judge_every_request(tmp_path: Path) -> None:
    """S3 across files goes on past a connection to no known Decode, and a Decode that
    never saw the connection received nothing on it; R1/R2 go on past a disagreement,
    and request keys may be null."""
    p = _trace(tmp_path / "p.jsonl", "prefill", [
        {"k": "conn", "t": 0.0, "ev": "open", "peer": "elsewhere:1", "conn": "c0"},
        {"k": "conn", "t": 0.0, "ev": "open", "peer": "d0:7000", "conn": "c1"},
        _msg("send", "d0:7000", "mf_meta", conn="c1"),
        _msg("send", "d0:7000", "read_ready_batch", 0, conn="c1"),
        _msg("recv", "d0:7000", "read_done", 0, conn="c1"),
    ])
    d = _trace(tmp_path / "d.jsonl", "decode", [], endpoint="d0:7000")
    assert _where(validate([p, d])) == [
        ("p.jsonl", 6, "S3", f"connection c1: Prefill sent READYs per layer {{0: 1}}, {d} "
                             "received {}")]

    def rank(name: str, outcomes: dict) -> Path:
        recs = []
        for key, ends in outcomes.items():
            recs.append(_tr("request_status", key, "start", "", "registered"))
            recs.append(_tr("request_status", key, "contributor_final", "registered",
                            "local_ok"))
            if ends:
                recs.append(_tr("request_status", key, "tp_agreed", "local_ok", ends))
        return _trace(tmp_path / name, "decode", recs)

    d0 = rank("d0.jsonl", {"a": "succeeded", "b": "succeeded", None: "succeeded"})
    d1 = rank("d1.jsonl", {"a": "failed", "b": None, None: "succeeded"})
    assert _where(validate([d0, d1])) == [
        ("d1.jsonl", 4, "R2", "request 'a' ended 'failed' here but the Decode ranks "
                              f"disagree: {{{str(d0)!r}: 'succeeded', {str(d1)!r}: 'failed'}}"),
        ("d1.jsonl", 5, "R1", "request 'b' is terminal on another Decode rank but never "
                              "reached a terminal state here"),
    ]


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(("payload", "expected"), [
    (wire.RAW_ACK, ("ack", None)),
    (wire.encode(wire.ReadDone(3)), ("read_done", 3)),
    (bytearray(wire.encode(wire.ReadDone(3))), ("read_done", 3)),
    (wire.encode(wire.ReadFailed(4, "x" * 100)), ("read_failed", 4)),
    (wire.encode(wire.ReadReadyBatch(9, "l", (), ())), ("read_ready_batch", 9)),
    (_pack([b"mf_meta_ack"]), ("mf_meta_ack", None)),  # one field: a kind alone
    (_pack([b"\xffx", 1]), ("\ufffdx", None)),  # a kind that is not ASCII, shown
    (_pack([wire.READ_DONE, True]), ("read_done", None)),  # a layer that is no int
    (_pack([]), ("malformed", None)),
    (_pack(["read_done", 3]), ("malformed", None)),  # a kind must be bytes
    (_pack([5, 3]), ("malformed", None)),
    (_pack([wire.READ_DONE, msgpack.ExtType(1, b"x")]), ("malformed", None)),
    (b"\xc1", ("malformed", None)),
])
def test_a_frame_is_summarized_by_its_kind_and_layer(payload: bytes,
                                                     expected: tuple) -> None:
    """What a trace records for a frame; anything that is not a well-formed frame head is
    'malformed', never an exception."""
    assert summarize(payload) == expected
