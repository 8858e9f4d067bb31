"""Sequence diagrams of real runs, drawn from their traces (``sfa-rd2h diagrams --sequence``).

Each process of a traced run is a lifeline (a column); each frame it sent or received is a
box on it, in the order of its trace; an arrow joins a send to the receive it became on
the other end of the connection; between the boxes, in plain text, are the machine
transitions the process fired, in order - what a received frame set off, and what led to
the next frame sent. Traces carry no common
clock, so nothing is placed by time: Graphviz lays the points out by causality alone
(a receive is below its send, a process's points are in order).

Pairing follows the trace format (``statemachines.trace``): a Prefill records the
connection identity (``conn``) and the Decode endpoint (``peer``); a Decode records that
identity as its ``peer``, and its endpoint in its header. The n-th frame of a kind and layer
one end sent on a connection is the n-th of that kind and layer the other end received.

``write_example`` draws the committed example: a small model-checker deployment, run
deterministically and recorded with the runtime's ``Tracer``, so ``diagrams --check`` can
regenerate it and compare.
"""

from __future__ import annotations

import html
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfa_rd2h.statemachines import render, trace

EXAMPLE_NAME = "sequence_example"
MAX_EVENTS = 400  # points drawn at most; a longer run is cut, and the diagram says so
_MAX_FIRED = 8  # transitions listed under one point; more are counted
_KIND_LABEL = {"mf_meta": "MF_META", "mf_meta_ack": "MF_META_ACK", "ack": "ACK",
               "read_ready_batch": "READY", "read_done": "READ_DONE",
               "read_failed": "READ_FAILED", "malformed": "malformed frame"}


@dataclass
class _Event:
    node: str
    label: str  # the frame; "" for a group of transitions fired between two frames
    fired: list[str] = field(default_factory=list)


@dataclass
class _Process:
    name: str
    role: str
    endpoint: str | None
    events: list[_Event] = field(default_factory=list)
    frames: list[tuple[str, str, str, int | None, str]] = field(default_factory=list)
    # (direction, connection id, kind, layer, node)
    reaches: dict[str, str] = field(default_factory=dict)  # Prefill: connection -> endpoint


def trace_files(folder: Path) -> list[Path]:
    """The ``*.jsonl`` traces of ``folder``; ``ValueError`` when there is none."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder of traces")
    paths = sorted(folder.glob("*.jsonl"))
    if not paths:
        raise ValueError(f"no trace files (*.jsonl) found in {folder}")
    return paths


def _frame_label(rec: dict[str, Any]) -> str:
    kind = _KIND_LABEL.get(str(rec.get("kind")), str(rec.get("kind")))
    layer = rec.get("layer")
    return kind if layer is None else f"{kind} L{layer}"


def _fired_label(rec: dict[str, Any]) -> str:
    key = str(rec.get("key", ""))
    if rec.get("ev") == "start":
        return f"{rec['m']}[{key}] starts {rec.get('dst')}"
    return f"{rec['m']}[{key}] {rec.get('src')} -{rec.get('ev')}-> {rec.get('dst')}"


def _load(index: int, path: Path, budget: list[int]) -> _Process:
    proc = _Process(path.stem, "", None)
    current: _Event | None = None
    for _, rec in trace.records(path):
        kind = rec.get("k")
        if kind == "process":
            proc.name = str(rec.get("name", path.stem))
            proc.role = str(rec.get("role", ""))
            proc.endpoint = rec.get("endpoint")
        elif kind == "info" and "endpoint" in rec:
            proc.endpoint = rec["endpoint"]
        elif kind == "tr" and (budget[0] > 0 or current is not None and not current.label):
            if current is None or current.label:
                current = _Event(f"p{index}_{len(proc.events)}", "")
                proc.events.append(current)
            current.fired.append(_fired_label(rec))
        elif kind == "msg" and budget[0] > 0:
            budget[0] -= 1
            node = f"p{index}_{len(proc.events)}"
            direction = str(rec.get("dir"))
            current = _Event(node, ("send " if direction == "send" else "recv ")
                             + _frame_label(rec))
            proc.events.append(current)
            conn = str(rec.get("peer", ""))
            if proc.role == "prefill":
                conn = str(rec.get("conn") or conn)
                proc.reaches[conn] = str(rec.get("peer", ""))
            proc.frames.append((direction, conn, str(rec.get("kind")), rec.get("layer"), node))
        elif kind == "msg":
            budget[1] += 1
    return proc


def _pairs(procs: list[_Process]) -> list[tuple[str, str, str]]:
    """(send node, receive node, label) of every frame both ends of which are traced."""
    decode_by_endpoint = {p.endpoint: p for p in procs if p.role == "decode" and p.endpoint}
    edges = []
    for p in procs:
        for conn, endpoint in p.reaches.items():
            d = decode_by_endpoint.get(endpoint)
            if d is None:
                continue  # the other end is not in this set of traces
            mine = [f for f in p.frames if f[1] == conn]
            theirs = [f for f in d.frames if f[1] == conn]
            for sender, receiver in ((mine, theirs), (theirs, mine)):
                got: dict[tuple[str, Any], list[str]] = defaultdict(list)
                for direction, _, kind, layer, node in receiver:
                    if direction == "recv":
                        got[(kind, layer)].append(node)
                used: Counter[tuple[str, Any]] = Counter()
                for direction, _, kind, layer, node in sender:
                    if direction != "send":
                        continue
                    key = (kind, layer)
                    if used[key] < len(got[key]):
                        label = _KIND_LABEL.get(kind, kind) + \
                            ("" if layer is None else f" L{layer}")
                        edges.append((node, got[key][used[key]], label))
                    used[key] += 1
    return edges


def dot_from_traces(paths: list[Path], title: str = "traced run",
                    max_events: int = MAX_EVENTS) -> str:
    """DOT of one sequence diagram of the run whose traces are ``paths``."""
    budget = [max_events, 0]  # frames still drawable, frames left out
    procs = [_load(i, path, budget) for i, path in enumerate(paths)]
    # Prefill lifelines on the left, Decode on the right, as the data flows.
    order = {"prefill": 0, "decode": 1}
    procs.sort(key=lambda p: (order.get(p.role, 2), p.name))
    return _dot(procs, _pairs(procs), title, budget[1])


def _event_node(ev: _Event) -> str:
    """A frame is a box; the transitions fired before the next frame are plain text on
    the lifeline, in the order the process fired them."""
    if ev.label:
        return f"{ev.node} [label=<<b>{html.escape(ev.label, quote=False)}</b>>]"
    fired = ev.fired[:_MAX_FIRED]
    rows = [html.escape(f, quote=False) for f in fired]
    if len(ev.fired) > len(fired):
        rows.append(f"... {len(ev.fired) - len(fired)} more")
    text = "<br/>".join(rows)
    return (f'{ev.node} [label=<<font point-size="8" color="#404040">{text}</font>> '
            f"shape=plaintext style=solid]")


def _dot(procs: list[_Process], edges: list[tuple[str, str, str]], title: str,
         left_out: int) -> str:
    lines = [
        "digraph sequence {",
        f"\tgraph [label={_q(title)} labelloc=t fontname={render.FONT} fontsize=13 "
        "rankdir=TB nodesep=0.35 ranksep=0.25 newrank=true]",
        f'\tnode [shape=box style="rounded,filled" fillcolor="#ffffff" '
        f'fontname={render.FONT} fontsize=9 color="#666666"]',
        f"\tedge [fontname={render.FONT} fontsize=8]",
    ]
    for i, p in enumerate(procs):
        role = f" ({p.role})" if p.role else ""
        lines += [f"\tsubgraph cluster_{i} {{",
                  f'\t\tlabel={_q(p.name + role)} style="dashed" color="#999999" '
                  f"fontsize=11",
                  f'\t\th{i} [label={_q(p.name)} shape=box style="filled" '
                  f'fillcolor={_q(render.INITIAL_FILL if p.role == "prefill" else "#dde7f7")}]']
        prev = f"h{i}"
        for ev in p.events:
            lines.append(f"\t\t{_event_node(ev)}")
            lines.append(f'\t\t{prev} -> {ev.node} [style=dashed arrowhead=none '
                         f'color="#aaaaaa" weight=20]')
            prev = ev.node
        lines.append("\t}")
    for a, b, label in edges:
        colour = "#b03020" if "FAILED" in label else "#204080"
        lines.append(f"\t{a} -> {b} [label={_q(label)} color={_q(colour)} "
                     f"fontcolor={_q(colour)} constraint=true weight=0]")
    heads = " ".join(f"h{i}" for i in range(len(procs)))
    lines.append(f"\t{{rank=same {heads}}}")
    if left_out:
        lines.append(f'\tnote [label={_q(f"{left_out} more frames not drawn")} shape=note]')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# --------------------------------------------------------------------------- the example


def example_traces(folder: Path) -> list[Path]:
    """A small deployment (2 Prefill ranks, 1 Decode rank, 2 layers on one slot, one
    request) run by the model checker's cluster in a fixed order, traced by ``Tracer``."""
    from sfa_rd2h.model_check.cluster import Cluster, RequestSpec, Scope

    scope = Scope(p_tp=2, d_tp=1, n_layers=2, n_slots=1, indexer=False,
                  requests=(RequestSpec(3, (3,)),), max_faults=0)
    cluster = Cluster(scope, trace_dir=folder)
    while ops := cluster.enabled(faults=False, timers=False):
        cluster.apply(ops[0])  # always the first enabled operation: deterministic
    cluster.check_quiescent()
    cluster.close_traces()
    return trace_files(folder)


def example_dot() -> str:
    with tempfile.TemporaryDirectory(prefix="sfa-rd2h-sequence-") as tmp:
        paths = example_traces(Path(tmp))
        return dot_from_traces(paths, title="One request over 2 layers on 1 slot, p_tp=2 "
                                            "d_tp=1: a model-checker run traced by Tracer")


def write_example(out_dir: Path, svg: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    dot = example_dot()
    path = out_dir / f"{EXAMPLE_NAME}.dot"
    path.write_text(dot)
    written = [path]
    if svg:
        svg_path = out_dir / f"{EXAMPLE_NAME}.svg"
        svg_path.write_text(render.render_svg(dot))
        written.append(svg_path)
    return written


def stale_example(out_dir: Path) -> list[str]:
    path = out_dir / f"{EXAMPLE_NAME}.dot"
    return [] if path.exists() and path.read_text() == example_dot() else [EXAMPLE_NAME]
