"""``sfa-rd2h review OLD NEW``: a protocol change, drawn and explained.

For every machine of either snapshot the page draws the union of both versions with the
product's diagram style: rows the change added green, removed red and dashed, changed amber
(same source, trigger and destination with other guards, effects or rule IDs). Clicking an
edge or a state shows its rows in both versions and, for every rule they cite, the rule's
text (a word diff where it changed), the checker's predicates that judge it, the seeded bugs
that break it and the tests that cite it - the facts ``sfa-rd2h reference`` gathers, from
the live checkout. The change list beside the diagrams is ``snapshot.diff_specs``'s, the
review ``sfa-rd2h spec diff`` prints.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from sfa_rd2h.model_check.invariants import PREDICATES
from sfa_rd2h.model_check.mutants import BUGS
from sfa_rd2h.runtime.tools import reference
from sfa_rd2h.runtime.tools.review.page import (
    PageError,
    draw_machine,
    fill,
    spec_from_snapshot,
    word_diff,
)
from sfa_rd2h.statemachines import snapshot

SNAPSHOT_PATH = "spec/snapshot.json"


def load_snapshot(arg: str, repo: Path) -> tuple[dict[str, Any], str]:
    """A snapshot from a file, or from ``spec/snapshot.json`` at git revision ``arg`` of
    ``repo``; with the label the page shows for it. ``PageError`` says why not."""
    path = Path(arg)
    if path.is_file():
        text, label = path.read_text(encoding="utf-8"), str(path)
    else:
        try:
            out = subprocess.run(["git", "-C", str(repo), "show", f"{arg}:{SNAPSHOT_PATH}"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            raise PageError(f"{arg} is no file, and git cannot be asked: {exc}") from None
        if out.returncode != 0:
            why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "git failed"
            raise PageError(f"{arg} is neither a snapshot file nor a git revision of "
                            f"{repo} holding {SNAPSHOT_PATH} ({why})")
        text, label = out.stdout, f"{arg}:{SNAPSHOT_PATH}"
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise PageError(f"{label} is not JSON: {exc}") from None
    problem = snapshot.not_a_snapshot(obj)
    if problem:
        raise PageError(f"{label} is not a spec snapshot ({problem})")
    return obj, label


def _row_text(t: dict[str, Any]) -> str:
    guards = list(t.get("conditions", [])) + [f"not {u}" for u in t.get("unless", [])]
    text = f"{t['source']} --{t['trigger']}"
    text += f" [{', '.join(guards)}]" if guards else ""
    text += f" / {', '.join(t['effects'])}" if t.get("effects") else ""
    return text + f" --> {t['dest']} ({', '.join(t['rules'])})"


def _merge_rows(old: list[dict], new: list[dict]) -> list[tuple[str, dict | None, dict | None]]:
    """(status, old row, new row) of the union: the new table's rows in order, then the
    removed ones. Rows match by ``snapshot``'s transition key (source, trigger, guards,
    destination); an unmatched new row with the source, trigger and destination of an
    unmatched old one is that row changed."""
    def key(t: dict) -> tuple:  # what `spec diff` matches rows by
        return (t["source"], t["trigger"], tuple(t.get("conditions", ())),
                tuple(t.get("unless", ())), t["dest"])

    free: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(old):
        free[key(t)].append(i)
    merged: list[tuple[str, dict | None, dict | None]] = []
    used: set[int] = set()
    for t in new:
        match = free.get(key(t))
        if match:
            i = match.pop(0)
            used.add(i)
            merged.append(("" if old[i] == t else "changed", old[i], t))
        else:
            merged.append(("added", None, t))
    for n, (status, _, t) in enumerate(merged):
        if status != "added":
            continue
        ends = (t["source"], t["trigger"], t["dest"])
        i = next((i for i, o in enumerate(old)
                  if i not in used and (o["source"], o["trigger"], o["dest"]) == ends), None)
        if i is not None:
            used.add(i)
            merged[n] = ("changed", old[i], t)
    merged += [("removed", o, None) for i, o in enumerate(old) if i not in used]
    return merged


def _merge_states(old: list[dict], new: list[dict]) -> list[tuple[str, dict | None, dict | None]]:
    before = {s["name"]: s for s in old}
    out: list[tuple[str, dict | None, dict | None]] = []
    for s in new:
        o = before.get(s["name"])
        out.append(("added" if o is None else "" if o == s else "changed", o, s))
    names = {s["name"] for s in new}
    return out + [("removed", s, None) for s in old if s["name"] not in names]


def _machine(name: str, old: dict | None, new: dict | None) -> dict[str, Any]:
    a = old or {"states": [], "transitions": [], "initial": None}
    b = new or {"states": [], "transitions": [], "initial": None}
    rows = _merge_rows(a["transitions"], b["transitions"])
    states = _merge_states(a["states"], b["states"])
    union = {"doc": (new or old or {}).get("doc", ""), "model": "",
             "initial": b["initial"] or a["initial"],
             "states": [s or o for _, o, s in states],
             "transitions": [t or o for _, o, t in rows]}
    drawing = draw_machine(spec_from_snapshot(name, union), [status for status, _, _ in rows],
                           {(s or o)["name"]: status for status, o, s in states})
    status = "added" if old is None else "removed" if new is None else (
        "changed" if any(r[0] for r in rows) or any(s[0] for s in states)
        or a["initial"] != b["initial"] else "")
    return {
        "name": name, "status": status, **drawing.as_json(),
        "rows": [{"status": st, "old": o and _row_text(o), "new": t and _row_text(t),
                  "source": (t or o)["source"], "dest": (t or o)["dest"],
                  "rules": sorted({*(o or {}).get("rules", []), *(t or {}).get("rules", [])})}
                 for st, o, t in rows],
        "states": [{"name": (s or o)["name"], "status": st,
                    "old": o and o.get("doc", ""), "new": s and s.get("doc", ""),
                    "diff": word_diff(o.get("doc", ""), s.get("doc", "")) if st == "changed"
                    else ""}
                   for st, o, s in states],
    }


def _fields(msg: dict[str, Any] | None) -> str:
    if msg is None:
        return ""
    return " ".join(f"{f['name']}:{f['type']}" for f in msg.get("fields", []))


def _rules(old: dict, new: dict, tests_dir: Path | None) -> dict[str, dict[str, Any]]:
    tests = reference.tests_by_rule(tests_dir) if tests_dir is not None else {}
    bugs: dict[str, list[str]] = defaultdict(list)
    for bug in BUGS:
        for rule_id in bug.rules:
            bugs[rule_id].append(bug.name)
    out = {}
    oi, ni = old["invariants"], new["invariants"]
    for rule_id in sorted(oi.keys() | ni.keys()):
        a, b = oi.get(rule_id), ni.get(rule_id)
        status = "added" if a is None else "removed" if b is None else (
            "" if a == b else "changed")
        old_text, new_text = (a or {}).get("text", ""), (b or {}).get("text", "")
        out[rule_id] = {
            "status": status, "text": new_text or old_text,
            "diff": word_diff(old_text, new_text) if status == "changed" else "",
            "checks": (b or a or {}).get("checks", []),
            "predicates": PREDICATES.get(rule_id, []), "bugs": bugs.get(rule_id, []),
            "tests": tests.get(rule_id, []),
        }
    return out


def review_data(old: dict[str, Any], new: dict[str, Any], old_label: str, new_label: str,
                tests_dir: Path | None) -> dict[str, Any]:
    """Everything the page shows, as JSON-able data."""
    om, nm = old["machines"], new["machines"]
    names = list(nm) + [n for n in om if n not in nm]
    wire = []
    for name in sorted(old["wire"].keys() | new["wire"].keys()):
        a, b = old["wire"].get(name), new["wire"].get(name)
        if a != b:
            status = "added" if a is None else "removed" if b is None else "changed"
            wire.append({"name": name, "status": status, "diff": word_diff(_fields(a), _fields(b))})
    return {
        "old": old_label, "new": new_label,
        "changes": snapshot.diff_specs(old, new),
        "machines": [_machine(n, om.get(n), nm.get(n)) for n in names],
        "rules": _rules(old, new, tests_dir), "wire": wire,
        "tests_found": tests_dir is not None,
    }


def render_html(data: dict[str, Any]) -> str:
    return fill(f"sfa-rd2h review: {data['old']} -> {data['new']}", data, "review.js", "review")


def render_markdown(data: dict[str, Any]) -> str:
    """The change list for a pull-request comment: one line per change, with rule IDs."""
    lines = [f"### Protocol review: `{data['old']}` -> `{data['new']}`", ""]
    if not data["changes"]:
        return "\n".join(lines + ["No protocol changes."]) + "\n"
    mark = {"added": "added", "removed": "removed", "changed": "changed"}
    lines += [f"- {line}" for line in data["changes"]
              if line.startswith(("protocol_version", "layout_version"))]
    for m in data["machines"]:
        items = [f"- {mark[r['status']]} `{r['new'] or r['old']}`"
                 + (f" (was `{r['old']}`)" if r["status"] == "changed" else "")
                 for r in m["rows"] if r["status"]]
        items += [f"- {mark[s['status']]} state `{s['name']}`" for s in m["states"]
                  if s["status"]]
        if items or m["status"] in ("added", "removed"):
            lines += [f"**{m['name']}**" + (f" ({m['status']} machine)"
                                            if m["status"] in ("added", "removed") else ""),
                      *items, ""]
    rules = [f"- {r['status']} **{rid}**: {r['text']}" for rid, r in data["rules"].items()
             if r["status"]]
    if rules:
        lines += ["**rules**", *rules, ""]
    if data["wire"]:
        lines += ["**wire**", *[f"- {w['status']} message `{w['name']}`" for w in data["wire"]],
                  ""]
    return "\n".join(lines).rstrip("\n") + "\n"
