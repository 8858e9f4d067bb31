"""Diagrams of the machines, drawn from the tables as DOT that teaches how to read it.

Every diagram carries a legend. A black dot points at the initial state (green), final
states have a double border, states a failure leads to are red, the others white. Each
state shows what it means (its ``doc``). Each edge shows the trigger, its guards in
brackets, the effects that run before the state changes after a slash, and the rule IDs
that the row keeps. Where several rows share a state and a trigger, the engine tries them
in table order and the first whose guards hold fires: those edges are numbered in that
order, and a row without guards after guarded ones reads ``[else]``: e.g.
``1. read_completed [result_ok]`` then ``2. read_completed [else]``.

The DOT depends only on the table, so it is byte-for-byte reproducible and is the reviewed
artefact (``--check`` compares it); SVG is derived from it with Graphviz ``dot``.
"""

from __future__ import annotations

import html
import shutil
import subprocess
import textwrap
from collections import Counter
from pathlib import Path

from sfa_rd2h.statemachines.tables import MACHINES, MachineSpec, StateSpec, TransitionSpec

FONT = "Helvetica"
INITIAL_FILL = "#d9f2d9"
FAILURE_FILL = "#f8d7d3"
PLAIN_FILL = "#ffffff"
_DOC_WIDTH = 34  # characters per line of a state's description


def is_failure(state: StateSpec) -> bool:
    """A state that a failure leads to (drawn red). Named so in every table: ``failed``,
    ``local_failed``, ``refused``."""
    return "fail" in state.name or state.name == "refused"


def _fill(spec: MachineSpec, state: StateSpec) -> str:
    if state.name == spec.initial:
        return INITIAL_FILL
    return FAILURE_FILL if is_failure(state) else PLAIN_FILL


def _quote(text: str) -> str:
    """A DOT string; a newline becomes DOT's centred line break ``\\n``."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def _state_label(state: StateSpec) -> str:
    lines = textwrap.wrap(state.doc, _DOC_WIDTH)
    doc = "<br/>".join(html.escape(line, quote=False) for line in lines)
    name = html.escape(state.name, quote=False)
    return f'<<b>{name}</b><br/><font point-size="9">{doc}</font>>'


def edge_labels(spec: MachineSpec) -> list[str]:
    """One label per transition, in table order: ``[n. ]trigger [guards] / effects (rules)``,
    numbered where several rows share (source, trigger)."""
    shared = Counter((t.source, t.trigger) for t in spec.transitions)
    seen: Counter[tuple[str, str]] = Counter()
    labels = []
    for t in spec.transitions:
        key = (t.source, t.trigger)
        seen[key] += 1
        order = f"{seen[key]}. " if shared[key] > 1 else ""
        labels.append(order + _edge_text(t, guarded_before=shared[key] > 1 and seen[key] > 1))
    return labels


def _edge_text(t: TransitionSpec, guarded_before: bool) -> str:
    guards = list(t.conditions) + [f"not {u}" for u in t.unless]
    text = t.trigger
    # Guards on a line of their own keep labels narrow, so a state's self-loops (several
    # on awaiting_replies) do not run into each other.
    if guards:
        text += f"\n[{', '.join(guards)}]"
    elif guarded_before:
        text += " [else]"
    if t.before:
        text += f"\n/ {', '.join(t.before)}"
    return text + f"\n({', '.join(t.rules)})"


def _legend() -> list[str]:
    """A small cluster that says what the shapes and colours mean."""
    def node(name: str, label: str, **attrs: str) -> str:
        extra = "".join(f" {k}={_quote(v)}" for k, v in attrs.items())
        return f"\t\t{name} [label={_quote(label)}{extra}]"

    return [
        "\tsubgraph cluster_legend {",
        '\t\tlabel="legend" fontsize=10 style="rounded,dashed" color="#999999"',
        "\t\tnode [fontsize=9 height=0.3]",
        "\t\tedge [fontsize=8]",
        '\t\tlegend_start [label="" shape=point width=0.12]',
        node("legend_initial", "initial", fillcolor=INITIAL_FILL),
        node("legend_plain", "in progress", fillcolor=PLAIN_FILL),
        node("legend_failure", "after a failure", fillcolor=FAILURE_FILL),
        node("legend_final", "final", fillcolor=PLAIN_FILL, peripheries="2"),
        "\t\tlegend_start -> legend_initial",
        "\t\tlegend_initial -> legend_plain "
        '[label="n. trigger\\n[guards]\\n/ effects\\n(rule IDs)"]',
        "\t\t{rank=same legend_plain legend_failure legend_final}",
        "\t\tlegend_plain -> legend_failure -> legend_final [style=invis]",
        "\t}",
    ]


def dot_source(spec: MachineSpec) -> str:
    lines = [
        f"digraph {spec.name} {{",
        f"\tgraph [label={_quote(f'{spec.name}: {spec.doc}')} labelloc=t fontname={FONT} "
        "fontsize=14 rankdir=TB nodesep=0.5 ranksep=0.55]",
        f'\tnode [shape=box style="rounded,filled" fontname={FONT} fontsize=11 '
        'color="#444444"]',
        f'\tedge [fontname={FONT} fontsize=9 color="#444444"]',
        '\t__initial [label="" shape=point width=0.15]',
        f"\t__initial -> {spec.initial}",
    ]
    for state in spec.states:
        attrs = f"fillcolor={_quote(_fill(spec, state))}"
        if state.final:
            attrs += " peripheries=2"
        lines.append(f"\t{state.name} [label={_state_label(state)} {attrs}]")
    # A state's self-loops become one loop listing every row, drawn where the first of them
    # is: Graphviz stacks several loops of one node, and their labels collide.
    labels = edge_labels(spec)
    loops: dict[str, list[str]] = {}
    for t, label in zip(spec.transitions, labels, strict=True):
        if t.source == t.dest:
            loops.setdefault(t.source, []).append(label)
    for t, label in zip(spec.transitions, labels, strict=True):
        if t.source != t.dest:
            lines.append(f"\t{t.source} -> {t.dest} [label={_quote(label)}]")
        elif label == loops[t.source][0]:
            merged = "\n\n".join(loops[t.source])
            lines.append(f"\t{t.source} -> {t.dest} [label={_quote(merged)}]")
    lines += _legend()
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot: str) -> str:
    if shutil.which("dot") is None:
        raise RuntimeError("Graphviz 'dot' is not installed (Debian package: graphviz)")
    out = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=True)
    return out.stdout


def write_diagrams(out_dir: Path, svg: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in MACHINES:
        dot = dot_source(spec)
        path = out_dir / f"{spec.name}.dot"
        path.write_text(dot)
        written.append(path)
        if svg:
            svg_path = out_dir / f"{spec.name}.svg"
            svg_path.write_text(render_svg(dot))
            written.append(svg_path)
    return written


def stale_diagrams(out_dir: Path) -> list[str]:
    """Names of machines whose committed DOT differs from what the table generates."""
    stale = []
    for spec in MACHINES:
        path = out_dir / f"{spec.name}.dot"
        if not path.exists() or path.read_text() != dot_source(spec):
            stale.append(spec.name)
    return stale
