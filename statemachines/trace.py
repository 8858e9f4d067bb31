"""JSON-lines traces of real runs, and their validation against the declared machines.

Every runtime process can write one trace file. A :class:`Tracer` is a
``statemachines.engine`` observer (one record per machine transition, exactly what the cores
fired) and also records, per frame, the message kind and layer that went over a ZMQ
connection (never whole payloads), plus connection lifecycle events.

``validate(paths)`` replays the files through the machines of ``statemachines.tables`` and
checks the cross-process rules a single core cannot see:

* every transition is declared: a record's source is the replayed state, (source, event) is
  in the table and its destination is one the table allows; the first record of a model is
  ``start`` in the initial state; nothing leaves a final state;
* W1: on every connection MF_META precedes the first READY a Prefill sends, and Decode
  answers a READY that came before MF_META only with READ_FAILED;
* S3: every READY gets exactly one reply - a reply never exceeds the READYs outstanding for
  its layer, a cleanly closed process leaves none unanswered, and where both ends of a
  connection are in the set, the counts each side sent equal the counts the other received;
* R1/R2: every request that reached a terminal state on one Decode rank reached the same
  one on every Decode rank of the set (one Decode instance per validation);
* W3/F2: on Decode, the reply sent for a READY is the one its ``decode_layer_read`` ended
  in - READ_DONE after ``done``, READ_FAILED after ``failed`` - so a trace whose machine
  state and wire contradict each other is a divergence, whichever of the two is wrong.

Record kinds (``k``): ``process`` (header; ``t0`` is the process's origin on the host-wide
monotonic clock, record times ``t`` are seconds after it), ``info``, ``tr`` (transition), ``msg``,
``conn`` and ``close`` (written by :meth:`Tracer.close`; its absence means the process did
not shut down cleanly, and end-of-run completeness checks are then skipped for that file).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import msgpack

from sfa_rd2h.spec import wire
from sfa_rd2h.statemachines.tables import BY_NAME

REPLY_KINDS = frozenset({"read_done", "read_failed"})
# decode_layer_read's final states and the reply each one sends (W3, F2)
_READ_REPLY = {"done": "read_done", "failed": "read_failed"}
_FLUSH_LINES = 512  # buffered records before a write; close() flushes the rest
_ARG_CHARS = 160  # error texts in transition arguments are cut to this length
_MAX_DIVERGENCES = 100


# --------------------------------------------------------------------------- frames


def records(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of every record of a trace file, for tools that show a
    trace (the validator reads its own way: it reports every bad line instead of stopping).
    A line that is no JSON object raises ``ValueError`` naming the file and the line."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    for line_no, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{path}:{line_no}: not a JSON record: {exc}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{line_no}: a trace record is a JSON object")
        yield line_no, rec


def summarize(payload: bytes) -> tuple[str, int | None]:
    """``(kind, layer)`` of a frame without decoding it fully; never raises.

    Only a short prefix is parsed, so this costs the same for a 10-byte reply and a
    multi-megabyte READY. The layer of a READY is ``wire.layer_of`` - the same rule the
    Decode core uses to decide whether a malformed READY can still be answered (W5).
    """
    if payload == wire.RAW_ACK:
        return "ack", None
    if type(payload) is bytes and len(payload) <= 64:
        # Replies and acks: the codec's decode of a frame this short is a table lookup
        # after the first time; a frame it refuses is summarized the long way below.
        try:
            msg = wire.decode(payload)
        except Exception:  # noqa: BLE001 - garbage is summarized below
            msg = None
        if isinstance(msg, wire.ReadDone | wire.ReadFailed):
            return ("read_done" if isinstance(msg, wire.ReadDone) else "read_failed",
                    msg.layer_idx)
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64, max_str_len=64,
                                    max_bin_len=64, max_array_len=64, max_map_len=64,
                                    max_ext_len=0)
        unpacker.feed(bytes(memoryview(payload)[:64]))
        if unpacker.read_array_header() < 1:
            return "malformed", None
        kind = unpacker.unpack()
        if not isinstance(kind, bytes):
            return "malformed", None
        name = kind.decode("ascii", "replace")
        if kind == wire.READ_READY_BATCH:
            return name, wire.layer_of(payload)
        if kind in (wire.READ_DONE, wire.READ_FAILED):
            layer = unpacker.unpack()
            return name, layer if type(layer) is int else None
        return name, None
    except Exception:  # noqa: BLE001 - garbage is a valid thing to summarize
        return "malformed", None


def _arg(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value[:_ARG_CHARS]
    if isinstance(value, set | frozenset | list | tuple):
        return sorted(str(v)[:_ARG_CHARS] for v in value)
    return str(value)[:_ARG_CHARS]


# --------------------------------------------------------------------------- writing


class Tracer:
    """Thread-safe, buffered JSON-lines trace of one process.

    Use it as the cores' ``observer=`` (it is callable with the observer signature) and
    call :meth:`message` for frames. ``info`` keys go into the header record (role, rank,
    endpoint, ...): ``validate`` reads ``role`` (``prefill``/``decode``) and, for Decode,
    ``endpoint`` to pair the two ends of a connection.
    """

    def __init__(self, path: str | os.PathLike[str], process_name: str, **info: Any) -> None:
        self.path = Path(path)
        self.process_name = process_name
        self._lock = threading.Lock()  # guards the buffer only; held for an append
        self._flush_lock = threading.Lock()  # serialises file writes, so records keep order
        self._buf: list[str] = []
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._t0 = time.monotonic()
        # t0: this process's origin on the host-wide monotonic clock, so the files of one
        # run (and a proxy's job timings, which use the same clock) line up on one axis.
        self._write({"k": "process", "name": process_name, "pid": os.getpid(),
                     "t0": round(self._t0, 6), **info})

    def _t(self) -> float:
        return round(time.monotonic() - self._t0, 6)

    def _write(self, record: dict[str, Any], *, may_flush: bool = True) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            if self._closed:
                return
            self._buf.append(line)
            full = len(self._buf) >= _FLUSH_LINES
        if full and may_flush:
            self._flush()

    def _flush(self) -> None:
        with self._flush_lock:
            with self._lock:
                if self._closed:
                    return
                lines, self._buf = self._buf, []
            if lines:
                self._file.write("\n".join(lines) + "\n")

    def __call__(self, machine: str, key: str, event: str, source: str, dest: str,
                 args: tuple) -> None:
        """The ``statemachines.engine`` observer hook.

        Cores call it under their worker's lock, so it only appends to the buffer; the
        file is written from the frame and connection records, which come outside it.
        """
        record: dict[str, Any] = {"k": "tr", "t": self._t(), "m": machine, "key": key,
                                  "ev": event, "src": source, "dst": dest}
        if args:
            record["a"] = [_arg(a) for a in args]
        self._write(record, may_flush=False)

    def message(self, direction: str, peer: str, payload: bytes, *,
                conn: str | None = None) -> None:
        """One frame ``send``/``recv`` on a connection: its kind and layer only."""
        kind, layer = summarize(payload)
        record: dict[str, Any] = {"k": "msg", "t": self._t(), "dir": direction,
                                  "peer": peer, "kind": kind}
        if layer is not None:
            record["layer"] = layer
        if conn is not None:
            record["conn"] = conn
        self._write(record)

    def connection(self, event: str, peer: str, conn: str) -> None:
        """Connection lifecycle on Prefill: ``open``, ``lost`` or ``close``."""
        self._write({"k": "conn", "t": self._t(), "ev": event, "peer": peer, "conn": conn})

    def info(self, **fields: Any) -> None:
        self._write({"k": "info", "t": self._t(), **fields})

    def abandon(self) -> None:
        """Flush and close without the ``close`` marker: what a killed process leaves
        behind (the model checker uses it for a restarted Decode)."""
        self._flush()
        with self._flush_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._file.close()

    def close(self) -> None:
        """Flush everything and mark the process as cleanly closed. Idempotent."""
        self._write({"k": "close", "t": self._t()}, may_flush=False)
        with self._flush_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                lines, self._buf = self._buf, []
            if lines:
                self._file.write("\n".join(lines) + "\n")
            self._file.close()

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Divergence:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


@dataclass
class Report:
    """The outcome of :func:`validate`; truthy when no divergence was found."""

    files: int = 0
    records: int = 0
    transitions: int = 0
    messages: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    unclosed: list[str] = field(default_factory=list)  # no close record: did not shut down

    @property
    def ok(self) -> bool:
        return not self.divergences

    @property
    def divergence(self) -> Divergence | None:
        """The first divergence, in file order then line order."""
        return self.divergences[0] if self.divergences else None

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        head = (f"{self.files} trace(s), {self.records} records, {self.transitions} "
                f"transitions, {self.messages} messages")
        if self.ok:
            tail = f"; not closed cleanly: {self.unclosed}" if self.unclosed else ""
            return f"valid: {head}{tail}"
        more = len(self.divergences) - 1
        tail = f" (+{more} more)" if more else ""
        return f"DIVERGENCE: {self.divergence}{tail}\n  in {head}"


@dataclass
class _Conn:
    """One connection seen from one end: READY and reply counts per layer."""

    last_line: int  # where the connection was last seen (S3 divergences point there)
    peer: str
    meta: bool = False
    lost: bool = False
    readys: Counter = field(default_factory=Counter)
    replies: Counter = field(default_factory=Counter)
    outstanding: Counter = field(default_factory=Counter)
    unmet: Counter = field(default_factory=Counter)  # Decode: READYs that came before MF_META


@dataclass
class _File:
    path: str
    role: str = ""
    endpoint: str | None = None
    closed: bool = False
    last_line: int = 0
    conns: dict[str, _Conn] = field(default_factory=dict)  # prefill: by identity hex
    finals: dict[str, tuple[int, str]] = field(default_factory=dict)  # request -> (line, st)
    started: dict[str, int] = field(default_factory=dict)  # request -> line
    # Decode: (peer, layer) -> the replies its ended layer reads call for, oldest first:
    # (reply kind, line of the final transition, read key)
    replies_due: dict[tuple[str, int], deque[tuple[str, int, str]]] = field(
        default_factory=lambda: defaultdict(deque))


class _Validator:
    def __init__(self) -> None:
        self.report = Report()
        self.allowed: dict[str, dict[tuple[str, str], set[str]]] = {}
        for name, spec in BY_NAME.items():
            table: dict[tuple[str, str], set[str]] = defaultdict(set)
            for t in spec.transitions:
                table[(t.source, t.trigger)].add(t.dest)
            self.allowed[name] = dict(table)
        self.files: list[_File] = []

    def fail(self, path: str, line: int, rule: str, message: str) -> None:
        if len(self.report.divergences) < _MAX_DIVERGENCES:
            self.report.divergences.append(Divergence(path, line, rule, message))

    # -- one file

    def load(self, path: str) -> None:
        f = _File(path)
        self.files.append(f)
        self.report.files += 1
        states: dict[tuple[str, str], str] = {}
        try:
            # undecodable bytes become lone surrogates, so one bad line is reported below
            # instead of ending the whole file with a UnicodeDecodeError
            fh = open(path, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
        except OSError as exc:
            self.fail(path, 0, "trace", f"cannot read: {exc}")
            return
        with fh:
            for line_no, raw in enumerate(fh, 1):
                f.last_line = line_no
                if not raw.strip():
                    continue
                try:
                    raw.encode("utf-8")
                except UnicodeEncodeError:
                    self.fail(path, line_no, "trace", "not a JSON record: not UTF-8 text")
                    continue
                try:
                    rec = json.loads(raw)
                except (ValueError, RecursionError) as exc:
                    self.fail(path, line_no, "trace", f"not a JSON record: {exc}")
                    continue
                if not isinstance(rec, dict):
                    self.fail(path, line_no, "trace", "record is not a JSON object")
                    continue
                self.report.records += 1
                bad = _bad_field(rec)
                if bad is not None:
                    self.fail(path, line_no, "trace", bad)
                    continue
                kind = rec.get("k")
                if line_no == 1 and kind != "process":
                    self.fail(path, 1, "trace", "first record is not a process header")
                if kind == "process":
                    f.role = str(rec.get("role", ""))
                    f.endpoint = rec.get("endpoint")
                elif kind == "info":
                    if "endpoint" in rec:
                        f.endpoint = rec["endpoint"]
                elif kind == "tr":
                    self.report.transitions += 1
                    self._transition(f, states, line_no, rec)
                elif kind == "msg":
                    self.report.messages += 1
                    self._message(f, line_no, rec)
                elif kind == "conn":
                    self._conn_event(f, line_no, rec)
                elif kind == "close":
                    f.closed = True
                else:
                    self.fail(path, line_no, "trace", f"unknown record kind {kind!r}")
        if f.last_line == 0:
            self.fail(path, 0, "trace", "empty: the process never flushed its trace")
        if f.closed:
            self._end_of_file(f)
        else:
            self.report.unclosed.append(path)

    def _transition(self, f: _File, states: dict[tuple[str, str], str], line: int,
                    rec: dict[str, Any]) -> None:
        machine, key, ev = rec.get("m"), rec.get("key"), rec.get("ev")
        src, dst = rec.get("src"), rec.get("dst")
        spec = BY_NAME.get(machine)  # type: ignore[arg-type]
        if spec is None:
            self.fail(f.path, line, "machines", f"unknown machine {machine!r}")
            return
        ident = (machine, key)
        where = f"{machine}[{key}]"
        if ev == "start":
            if ident in states:
                self.fail(f.path, line, "machines", f"{where} started twice")
            elif dst != spec.initial:
                self.fail(f.path, line, "machines",
                          f"{where} starts in {dst!r}, not the initial state {spec.initial!r}")
            states[ident] = spec.initial
            if machine == "request_status":
                f.started[key] = line
            return
        current = states.get(ident)
        if current is None:
            self.fail(f.path, line, "machines", f"{where}: {ev!r} before its start record")
            states[ident] = dst
            return
        if src != current:
            self.fail(f.path, line, "machines",
                      f"{where}: record says {ev!r} from {src!r}, replay is in {current!r}")
        if current in spec.final_states:
            self.fail(f.path, line, "machines",
                      f"{where}: {ev!r} leaves final state {current!r}")
        else:
            dests = self.allowed[machine].get((current, ev))
            if dests is None:
                self.fail(f.path, line, "machines",
                          f"{where}: {ev!r} is not declared from {current!r}")
            elif dst not in dests:
                self.fail(f.path, line, "machines",
                          f"{where}: {ev!r} from {current!r} goes to {sorted(dests)}, "
                          f"record says {dst!r}")
        states[ident] = dst
        if machine == "request_status" and dst in spec.final_states:
            f.finals[key] = (line, dst)
        if machine == "decode_layer_read" and dst in _READ_REPLY:
            due = _read_peer_layer(key)
            if due is not None:
                f.replies_due[due].append((_READ_REPLY[dst], line, str(key)))

    def _conn(self, f: _File, conn_id: str, peer: str, line: int) -> _Conn:
        c = f.conns.get(conn_id)
        if c is None:
            c = f.conns[conn_id] = _Conn(line, peer)
        else:
            c.last_line = line
        return c

    def _message(self, f: _File, line: int, rec: dict[str, Any]) -> None:
        direction, kind, layer = rec.get("dir"), rec.get("kind"), rec.get("layer")
        peer = str(rec.get("peer", ""))
        if f.role == "prefill":
            conn_id = str(rec.get("conn") or peer)
            outgoing = direction == "send"
        else:
            conn_id = peer
            outgoing = direction == "recv"  # on Decode, READYs come in and replies go out
        c = self._conn(f, conn_id, peer, line)
        if f.role == "decode" and direction == "send" and kind in REPLY_KINDS \
                and layer is not None:
            self._reply_matches_read(f, line, peer, layer, str(kind))
        if outgoing and kind == "mf_meta":
            c.meta = True
        elif outgoing and kind == "read_ready_batch" and layer is not None:
            if not c.meta and f.role == "prefill":
                self.fail(f.path, line, "W1",
                          f"READY for layer {layer} on connection {conn_id} before MF_META")
            elif not c.meta:
                # Decode cannot stop a peer from sending this; it must refuse it (W1).
                c.unmet[layer] += 1
            c.readys[layer] += 1
            c.outstanding[layer] += 1
        elif not outgoing and kind in REPLY_KINDS and layer is not None:
            if c.unmet[layer] > 0:
                c.unmet[layer] -= 1
                if kind != "read_failed":
                    self.fail(f.path, line, "W1",
                              f"{kind} for layer {layer} on connection {conn_id} answers a "
                              "READY that came before MF_META; only READ_FAILED may")
            c.replies[layer] += 1
            if c.outstanding[layer] <= 0:
                self.fail(f.path, line, "S3",
                          f"{kind} for layer {layer} on connection {conn_id} answers no "
                          "outstanding READY")
            else:
                c.outstanding[layer] -= 1

    def _reply_matches_read(self, f: _File, line: int, peer: str, layer: int,
                            kind: str) -> None:
        """W3/F2: a reply says what the layer read it answers ended in."""
        due = f.replies_due.get((peer, layer))
        if not due:
            return  # no ended read recorded for it (an older trace): nothing to compare
        want, read_line, read_key = due.popleft()
        if kind != want:
            rule = "F2" if want == "read_failed" else "W3"
            ended = "failed" if want == "read_failed" else "done"
            self.fail(f.path, line, rule,
                      f"{kind} for layer {layer} to {peer} answers decode_layer_read"
                      f"[{read_key}], which ended {ended!r} at line {read_line}; it calls "
                      f"for {want}")

    def _conn_event(self, f: _File, line: int, rec: dict[str, Any]) -> None:
        c = self._conn(f, str(rec.get("conn")), str(rec.get("peer", "")), line)
        if rec.get("ev") == "lost":
            c.lost = True  # S5: outstanding READYs are failed by the core, not answered

    def _end_of_file(self, f: _File) -> None:
        for conn_id, c in f.conns.items():
            if c.lost:
                continue
            left = {layer: n for layer, n in c.outstanding.items() if n > 0}
            if left:
                self.fail(f.path, c.last_line, "S3",
                          f"connection {conn_id} closed with unanswered READY(s) per layer "
                          f"{left}")

    # -- across files

    def cross(self) -> None:
        decode = [f for f in self.files if f.role == "decode"]
        prefill = [f for f in self.files if f.role == "prefill"]
        by_endpoint = {f.endpoint: f for f in decode if f.endpoint}
        for p in prefill:
            for conn_id, c in p.conns.items():
                d = by_endpoint.get(c.peer)
                if d is None or c.lost or not (p.closed and d.closed):
                    continue
                dc = d.conns.get(conn_id)
                got_r = dc.readys if dc is not None else Counter()
                got_a = dc.replies if dc is not None else Counter()
                if +c.readys != +got_r:
                    self.fail(p.path, c.last_line, "S3",
                              f"connection {conn_id}: Prefill sent READYs per layer "
                              f"{dict(c.readys)}, {d.path} received {dict(got_r)}")
                elif +c.replies != +got_a:
                    self.fail(p.path, c.last_line, "S3",
                              f"connection {conn_id}: {d.path} sent replies per layer "
                              f"{dict(got_a)}, Prefill received {dict(c.replies)}")
        keys = sorted({k for f in decode for k in f.finals}, key=str)  # a key may be null
        for key in keys:
            outcomes = {f.path: f.finals.get(key) for f in decode if key in f.started}
            seen = {v[1] for v in outcomes.values() if v is not None}
            if len(seen) > 1:
                path, (line, dst) = next((p, v) for p, v in outcomes.items()
                                         if v is not None and v[1] == "failed")
                others = {p: v[1] for p, v in outcomes.items() if v is not None}
                self.fail(path, line, "R2",
                          f"request {key!r} ended {dst!r} here but the Decode ranks disagree: "
                          f"{others}")
                continue
            for f in decode:
                if key in f.started and key not in f.finals and f.closed:
                    self.fail(f.path, f.started[key], "R1",
                              f"request {key!r} is terminal on another Decode rank but never "
                              "reached a terminal state here")


def _read_peer_layer(key: Any) -> tuple[str, int] | None:
    """``(peer, layer)`` of a Decode read key ``"<peer>/L<layer>/<serial>"``, or None."""
    parts = str(key).rsplit("/", 2)
    if len(parts) != 3 or not parts[1].startswith("L") or not parts[1][1:].isdigit():
        return None
    try:
        return parts[0], int(parts[1][1:])
    except ValueError:  # digits int() refuses: superscripts, or beyond its digit limit
        return None


# Fields the Tracer only ever writes as strings; a record with another JSON type there is
# malformed (and would otherwise reach dict keys, set membership or sorting as garbage).
_STR_FIELDS = ("k", "m", "key", "ev", "src", "dst", "dir", "peer", "kind", "conn", "role",
               "endpoint")


def _bad_field(rec: dict[str, Any]) -> str | None:
    """What is wrongly typed in a record, or None: a listed field that is present and not
    null must be a string, and ``layer`` an integer."""
    for name in _STR_FIELDS:  # in this order, so the report does not depend on key order
        value = rec.get(name)
        if value is not None and type(value) is not str:
            return f"field {name!r} must be a string, got {type(value).__name__}"
    layer = rec.get("layer")
    if layer is not None and type(layer) is not int:
        return f"field 'layer' must be an integer, got {type(layer).__name__}"
    return None


def validate(paths: Iterable[str | os.PathLike[str]]) -> Report:
    """Replay trace files through the machines and the cross-process rules."""
    v = _Validator()
    for path in paths:
        v.load(os.fspath(path))
    v.cross()
    return v.report
