"""What both reviewer pages build on: machine diagrams whose states and edges a script can
find, the word diff of two texts, and the filling of the page template.

The diagrams are the product's own (``statemachines.render.dot_source``), drawn by Graphviz;
this module only gives every state node the id ``s_<state>`` and every drawn edge the id
``e<k>`` (plus CSS classes), and says which table rows each drawn edge stands for: a state's
self-loops are drawn as one edge listing every row, so one edge may stand for several rows.
"""

from __future__ import annotations

import difflib
import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from sfa_rd2h.statemachines import render
from sfa_rd2h.statemachines.tables import MachineSpec, StateSpec, TransitionSpec

_NODE_LINE = re.compile(r"^\t(\w+) \[label=")
_EDGE_LINE = re.compile(r"^\t(\w+) -> (\w+) \[")
_PLACEHOLDER = re.compile(r"@@([A-Z_]+)@@")


class PageError(ValueError):
    """Input a page cannot be made from; the message says which and why."""


@dataclass(frozen=True)
class MachineDrawing:
    """One machine's inline SVG and, per drawn edge ``e<k>``, the table rows it draws."""

    svg: str
    edge_rows: list[list[int]]

    def as_json(self) -> dict[str, Any]:
        return {"svg": self.svg, "edge_rows": self.edge_rows}


def spec_from_snapshot(name: str, machine: Mapping[str, Any]) -> MachineSpec:
    """The ``MachineSpec`` a snapshot's machine entry describes (so an old revision's
    machine is drawn exactly like the live tables are)."""
    try:
        states = tuple(StateSpec(s["name"], s.get("doc", ""), bool(s.get("final")))
                       for s in machine["states"])
        rows = tuple(TransitionSpec(t["trigger"], t["source"], t["dest"], tuple(t["rules"]),
                                    tuple(t.get("conditions", ())), tuple(t.get("unless", ())),
                                    tuple(t.get("effects", ())))
                     for t in machine["transitions"])
        return MachineSpec(name, machine.get("doc", ""), machine.get("model", ""),
                           machine["initial"], states, rows)
    except (KeyError, TypeError, ValueError) as exc:
        raise PageError(f"machine {name!r} of the snapshot cannot be drawn: {exc}") from None


def _drawn_edges(spec: MachineSpec) -> list[list[int]]:
    """Table rows per drawn edge, in the order ``render.dot_source`` writes the edges."""
    loops: dict[str, list[int]] = {}
    for i, t in enumerate(spec.transitions):
        if t.source == t.dest:
            loops.setdefault(t.source, []).append(i)
    edges = []
    for i, t in enumerate(spec.transitions):
        if t.source != t.dest:
            edges.append([i])
        elif loops[t.source][0] == i:
            edges.append(loops[t.source])
    return edges


def draw_machine(spec: MachineSpec, row_class: Sequence[str] = (),
                 state_class: Mapping[str, str] | None = None) -> MachineDrawing:
    """The machine as inline SVG; ``row_class[i]`` (e.g. ``added``) marks the edge of row
    ``i``, ``state_class`` marks states by name."""
    edges = _drawn_edges(spec)
    state_class = state_class or {}
    states = set(spec.state_names)
    out, k = [], 0
    for line in render.dot_source(spec).splitlines():
        edge = _EDGE_LINE.match(line)
        node = _NODE_LINE.match(line)
        if edge and edge.group(1) != "__initial":
            if k >= len(edges):
                raise PageError(f"{spec.name}: the diagram draws more edges than the table has")
            classes = sorted({row_class[i] for i in edges[k] if i < len(row_class)} - {""})
            attrs = f'id="e{k}" class="row {" ".join(classes)}"'.replace(' "', '"')
            line = line.replace(" [", f" [{attrs} ", 1)
            k += 1
        elif node and node.group(1) in states:
            name = node.group(1)
            line = line.replace(" [", f' [id="s_{name}" class="state {state_class.get(name, "")}" ',
                                1)
        out.append(line)
    if k != len(edges):
        raise PageError(f"{spec.name}: the diagram drew {k} edges, the table needs {len(edges)}")
    svg = render.render_svg("\n".join(out) + "\n")
    start = svg.find("<svg")
    if start < 0:
        raise PageError(f"{spec.name}: Graphviz returned no SVG")
    return MachineDrawing(svg[start:], edges)


def word_diff(old: str, new: str) -> str:
    """HTML of ``new`` against ``old`` word by word: removed words in ``<del>``, added in
    ``<ins>``."""
    a, b = old.split(), new.split()
    parts = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            parts.append(html.escape(" ".join(a[i1:i2])))
            continue
        if i2 > i1:
            parts.append(f"<del>{html.escape(' '.join(a[i1:i2]))}</del>")
        if j2 > j1:
            parts.append(f"<ins>{html.escape(' '.join(b[j1:j2]))}</ins>")
    return " ".join(parts)


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def fill(title: str, data: Mapping[str, Any], script: str, body_class: str) -> str:
    """The whole page: the template with its CSS, the page's script and its data inlined.

    The data goes in as JSON inside a ``<script type="application/json">``; ``</`` is
    escaped so no string in it can close that element."""
    payload = json.dumps(data, separators=(",", ":"), sort_keys=True).replace("</", "<\\/")
    values = {"STYLE": _asset("page.css"), "COMMON": _asset("common.js"),
              "SCRIPT": _asset(script), "DATA": payload, "TITLE": html.escape(title),
              "BODY_CLASS": body_class}
    # One pass, so text inside a filled value is never taken for a placeholder.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _asset("template.html"))
