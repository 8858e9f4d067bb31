"""The reviewable spec snapshot: one canonical JSON of machines, wire schemas and rules.

``export_spec`` derives everything from the live tables, the wire dataclasses and the rule
catalog, so the committed ``spec/snapshot.json`` is stale exactly when the protocol changed.
``diff_specs`` turns two snapshots into the review a protocol engineer reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import sfa_rd2h.spec as spec_pkg
from sfa_rd2h.spec import invariants, wire
from sfa_rd2h.statemachines.tables import MACHINES

SNAPSHOT_FORMAT = 1
DEFAULT_PATH = Path(spec_pkg.__file__).resolve().parent / "snapshot.json"

_WIRE_CLASSES = {
    "MF_META": (wire.MF_META, wire.MfMeta),
    "MF_META_ACK": (wire.MF_META_ACK, wire.MfMetaAck),
    "READ_READY_BATCH": (wire.READ_READY_BATCH, wire.ReadReadyBatch),
    "READ_DONE": (wire.READ_DONE, wire.ReadDone),
    "READ_FAILED": (wire.READ_FAILED, wire.ReadFailed),
    "read_req": (None, wire.ReadReq),
    "layer_metadata": (None, wire.LayerMeta),
}


def _fields(cls: type) -> list[dict[str, str]]:
    return [{"name": f.name, "type": str(f.type)} for f in dataclasses.fields(cls)]


def export_spec() -> dict[str, Any]:
    machines = {}
    for m in MACHINES:
        machines[m.name] = {
            "doc": m.doc,
            "model": m.model,
            "initial": m.initial,
            "states": [{"name": s.name, "doc": s.doc, "final": s.final} for s in m.states],
            "transitions": [
                {
                    "trigger": t.trigger,
                    "source": t.source,
                    "dest": t.dest,
                    "conditions": list(t.conditions),
                    "unless": list(t.unless),
                    "effects": list(t.before),
                    "rules": list(t.rules),
                }
                for t in m.transitions
            ],
        }
    messages = {}
    for name, (kind, cls) in _WIRE_CLASSES.items():
        messages[name] = {
            "kind": kind.decode() if kind is not None else None,
            "fields": _fields(cls),
        }
    return {
        "format": SNAPSHOT_FORMAT,
        "protocol_version": wire.PROTOCOL_VERSION,
        "layout_version": wire.LAYOUT_VERSION,
        "machines": machines,
        "wire": messages,
        "invariants": {r.id: {"text": r.text, "checks": list(r.checks)} for r in invariants.RULES},
    }


def not_a_snapshot(obj: Any) -> str | None:
    """Why ``obj`` (parsed JSON) is not a spec snapshot ``diff_specs`` can review, or None."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    missing = [k for k in ("format", "machines", "wire", "invariants") if k not in obj]
    if missing:
        return f"no {', '.join(missing)} key(s): not a spec snapshot"
    if obj["format"] != SNAPSHOT_FORMAT:
        return f"snapshot format {obj['format']!r}; this tool reads format {SNAPSHOT_FORMAT}"
    for key in ("machines", "wire", "invariants"):
        if not isinstance(obj[key], dict):
            return f"{key!r} is not an object"
    for name, m in obj["machines"].items():
        if not (isinstance(m, dict) and isinstance(m.get("states"), list)
                and isinstance(m.get("transitions"), list)):
            return f"machine {name!r} has no states and transitions lists"
    return None


def dumps(snapshot: dict[str, Any]) -> str:
    return json.dumps(snapshot, indent=2, sort_keys=True) + "\n"


def write_snapshot(path: Path = DEFAULT_PATH) -> Path:
    path.write_text(dumps(export_spec()))
    return path


def is_fresh(path: Path = DEFAULT_PATH) -> bool:
    return path.exists() and path.read_text() == dumps(export_spec())


def _transition_key(t: dict[str, Any]) -> str:
    guard = " & ".join(t["conditions"] + [f"!{u}" for u in t["unless"]])
    return f"{t['source']} --{t['trigger']}{' [' + guard + ']' if guard else ''}--> {t['dest']}"


def _diff_keyed(old: dict, new: dict, label: str, show: Any) -> list[str]:
    lines = []
    for key in sorted(old.keys() - new.keys()):
        lines.append(f"  - removed {label} {key}")
    for key in sorted(new.keys() - old.keys()):
        lines.append(f"  + added {label} {key}{show(new[key])}")
    for key in sorted(old.keys() & new.keys()):
        if old[key] != new[key]:
            lines.append(f"  ~ changed {label} {key}: {show(old[key])} -> {show(new[key])}")
    return lines


def diff_specs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """A readable review of what changed between two snapshots; empty if nothing did."""
    out: list[str] = []
    for key in ("protocol_version", "layout_version"):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {old.get(key)} -> {new.get(key)}")
    om, nm = old.get("machines", {}), new.get("machines", {})
    for name in sorted(om.keys() - nm.keys()):
        out.append(f"machine {name}: removed")
    for name in sorted(nm.keys() | om.keys()):
        if name not in nm:
            continue
        a = om.get(name, {"states": [], "transitions": [], "initial": None})
        b = nm[name]
        lines = []
        if name not in om:
            lines.append("  + new machine")
        if a.get("initial") != b.get("initial") and name in om:
            lines.append(f"  ~ initial state {a.get('initial')} -> {b.get('initial')}")
        lines += _diff_keyed(
            {s["name"]: s for s in a["states"]},
            {s["name"]: s for s in b["states"]},
            "state",
            lambda s: f" ({'final, ' if s['final'] else ''}{s['doc']})",
        )
        lines += _diff_keyed(
            {_transition_key(t): t for t in a["transitions"]},
            {_transition_key(t): t for t in b["transitions"]},
            "transition",
            lambda t: f" effects={t['effects']} rules={t['rules']}",
        )
        if lines:
            out.append(f"machine {name}:")
            out += lines
    wire_lines = _diff_keyed(
        {k: v for k, v in old.get("wire", {}).items()},
        {k: v for k, v in new.get("wire", {}).items()},
        "message",
        lambda m: " fields=" + ", ".join(f"{f['name']}:{f['type']}" for f in m["fields"]),
    )
    if wire_lines:
        out.append("wire:")
        out += wire_lines
    inv_lines = _diff_keyed(
        old.get("invariants", {}),
        new.get("invariants", {}),
        "rule",
        lambda r: f" \"{r['text']}\" checks={r['checks']}",
    )
    if inv_lines:
        out.append("invariants:")
        out += inv_lines
    return out
