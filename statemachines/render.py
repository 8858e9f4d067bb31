"""Diagrams of the machines, drawn by transitions' GraphMachine from the tables.

Each diagram is rendered from a fresh model in the machine's initial state, so the output
depends only on the table and is byte-for-byte reproducible. DOT is the reviewed artefact
(``--check`` compares it); SVG is derived from it with Graphviz ``dot``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from transitions.extensions import GraphMachine
from transitions.extensions.states import Tags, add_state_features

from sfa_rd2h.statemachines.engine import build_machine
from sfa_rd2h.statemachines.tables import MACHINES, MachineSpec


@add_state_features(Tags)
class _TaggedGraphMachine(GraphMachine):
    """GraphMachine whose state labels show tags: final states read ``done [final]``.

    Drawn top to bottom: the guard labels are long, and left to right they run over the
    states."""

    machine_attributes = {**GraphMachine.machine_attributes, "rankdir": "TB"}


class _Fresh:
    """A model that exists only to be drawn in the initial state."""

    key = "diagram"


def dot_source(spec: MachineSpec) -> str:
    machine = build_machine(
        spec,
        _TaggedGraphMachine,
        state_kwargs=lambda s: {"tags": ["final"] if s.final else []},
        graph_engine="graphviz",
        show_conditions=True,
        show_state_attributes=True,
        title=f"{spec.name}: {spec.doc}",
    )
    model = _Fresh()
    machine.add_model(model)
    return model.get_graph().source


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
