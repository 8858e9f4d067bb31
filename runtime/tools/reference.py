"""``sfa-rd2h reference``: the protocol reference ``spec/PROTOCOL.md``, generated.

Everything in it comes from the project itself, so it cannot drift from what runs:

* the rule catalog (``spec.invariants.RULES``): every rule ID, its text, and the spec
  functions that decide it;
* the machine tables (``statemachines.tables``): the transitions that cite each rule, and
  every machine's states and rows in the order the engine tries them;
* the model checker: the invariant predicates registered against each rule
  (``model_check.invariants.PREDICATES``) and the seeded bugs that break it
  (``model_check.mutants.BUGS``);
* the tests: each ``test_*`` function whose comments or docstring cite a rule ID (the
  ``# R5``-style comments), found with ``tokenize`` and ``ast``, not a regular expression
  over whole files;
* the wire messages and their fields (the spec snapshot's ``wire`` section), and the wire
  encoding that ``spec.wire`` documents.

It is never edited by hand: ``sfa-rd2h reference --check`` (and a test) fail when it is stale,
exactly like the diagrams and ``spec/snapshot.json``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

import sfa_rd2h.spec as spec_pkg
from sfa_rd2h.model_check.invariants import PREDICATES
from sfa_rd2h.model_check.mutants import BUGS
from sfa_rd2h.spec import invariants, wire
from sfa_rd2h.statemachines.snapshot import export_spec
from sfa_rd2h.statemachines.tables import MACHINES, MachineSpec, TransitionSpec

DEFAULT_PATH = Path(spec_pkg.__file__).resolve().parent / "PROTOCOL.md"
_RULE_ID = re.compile(r"\b([A-Z][0-9]{1,2})\b")
_KNOWN = re.compile(r"^Known failure (\d+)")


# --------------------------------------------------------------------------- tests


def _cited(text: str) -> set[str]:
    return {m for m in _RULE_ID.findall(text) if m in invariants.BY_ID}


def _comments(source: str) -> dict[int, str]:
    """Line number -> comment text of one Python source."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def tests_by_rule(tests_dir: Path) -> dict[str, list[str]]:
    """Rule ID -> ``tests/FILE.py::test_name`` of every test function whose comments or
    docstring cite it."""
    found: dict[str, set[str]] = defaultdict(set)
    root = tests_dir.parent
    for path in sorted(tests_dir.glob("test_*.py")):
        source = path.read_text()
        comments = _comments(source)
        tree = ast.parse(source, str(path))
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and node.name.startswith("test_")):
                continue
            end = node.end_lineno or node.lineno
            text = " ".join(c for line, c in comments.items() if node.lineno <= line <= end)
            text += " " + (ast.get_docstring(node) or "")
            for rule_id in _cited(text):
                found[rule_id].add(f"{rel}::{node.name}")
    return {rule_id: sorted(names) for rule_id, names in found.items()}


# --------------------------------------------------------------------------- formatting


def _guards(t: TransitionSpec) -> str:
    parts = list(t.conditions) + [f"not {u}" for u in t.unless]
    return f" [{', '.join(parts)}]" if parts else ""


def _row(machine: MachineSpec, t: TransitionSpec) -> str:
    effects = f" / {', '.join(t.before)}" if t.before else ""
    return f"`{machine.name}`: `{t.source} --{t.trigger}{_guards(t)}{effects}--> {t.dest}`"


def _code(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _bug_label(name: str, doc: str) -> str:
    m = _KNOWN.match(doc)
    return f"`{name}` (known failure {m.group(1)})" if m else f"`{name}`"


def _rules_section(tests: dict[str, list[str]]) -> list[str]:
    out: list[str] = []
    by_rule_rows: dict[str, list[str]] = defaultdict(list)
    for m in MACHINES:
        for t in m.transitions:
            for rule_id in t.rules:
                by_rule_rows[rule_id].append(_row(m, t))
    by_rule_bugs: dict[str, list[str]] = defaultdict(list)
    for bug in BUGS:
        for rule_id in bug.rules:
            by_rule_bugs[rule_id].append(_bug_label(bug.name, bug.doc))
    group = ""
    for rule in invariants.RULES:
        if rule.group != group:
            group = rule.group
            out += [f"## {group}: {invariants.GROUPS.get(group, group)}", ""]
        out += [f"### {rule.id}", "", rule.text, ""]
        facts = [
            ("Transitions that cite it", by_rule_rows.get(rule.id, [])),
            ("Decided by the spec functions", [f"`{c}`" for c in rule.checks]),
            ("Judged by the model checker's predicates",
             [f"`{p}`" for p in PREDICATES.get(rule.id, [])]),
            ("Broken by the seeded bugs", by_rule_bugs.get(rule.id, [])),
            ("Exercised by the tests", [f"`{t}`" for t in tests.get(rule.id, [])]),
        ]
        for label, items in facts:
            if len(items) > 1 or (items and label.startswith("Transitions")):
                out.append(f"- {label}:")
                out += [f"  - {item}" for item in items]
            elif items:
                out.append(f"- {label}: {items[0]}")
            else:
                out.append(f"- {label}: none")
        out.append("")
    return out


def _machines_section() -> list[str]:
    out = ["## Machines", "",
           "Rows sharing a state and a trigger are tried in the order numbered; the first "
           "whose guards hold fires. `not g` means guard `g` must not hold. Effects run "
           "before the state changes. Diagrams: `diagrams/` (`sfa-rd2h diagrams`).", ""]
    for m in MACHINES:
        out += [f"### {m.name}", "", f"{m.doc} Model: `{m.model}`.", "",
                f"![{m.name}](../diagrams/{m.name}.svg)", "",
                "| state | | meaning |", "|---|---|---|"]
        for st in m.states:
            kind = "initial" if st.name == m.initial else ("final" if st.final else "")
            out.append(f"| `{st.name}` | {kind} | {st.doc} |")
        out += ["", "| # | from | trigger | guards | effects | to | rules |",
                "|---|---|---|---|---|---|---|"]
        seen: dict[tuple[str, str], int] = defaultdict(int)
        shared = defaultdict(int)
        for t in m.transitions:
            shared[(t.source, t.trigger)] += 1
        for t in m.transitions:
            seen[(t.source, t.trigger)] += 1
            order = seen[(t.source, t.trigger)] if shared[(t.source, t.trigger)] > 1 else ""
            guards = _guards(t).strip(" []")
            out.append(f"| {order} | `{t.source}` | `{t.trigger}` | {guards} | "
                       f"{', '.join(t.before)} | `{t.dest}` | {', '.join(t.rules)} |")
        out.append("")
    return out


def _messages_section() -> list[str]:
    out = ["## Messages", "",
           f"Protocol version {wire.PROTOCOL_VERSION}, layout version {wire.LAYOUT_VERSION}. "
           "Messages are msgpack arrays, the kind (bytes) first, then the fields in this "
           "order (W1-W4); `read_req` and `layer_metadata` are parts of messages.", ""]
    for name, msg in export_spec()["wire"].items():
        kind = f" (kind `{msg['kind']}`)" if msg["kind"] else ""
        fields = ", ".join(f"`{f['name']}`: {f['type']}" for f in msg["fields"])
        out.append(f"- **{name}**{kind}: {fields}")
    return out + ["", "### Wire encoding", "", *_wire_encoding(), ""]


def _wire_encoding() -> list[str]:
    """The "Wire encoding" section of ``spec.wire``'s docstring, as Markdown."""
    doc = wire.__doc__ or ""
    marker = "Wire encoding\n-------------\n"
    if marker not in doc:
        raise ValueError("spec/wire.py's docstring lost its 'Wire encoding' section")
    text = doc.split(marker, 1)[1].strip()
    return text.replace("``", "`").splitlines()


def _bugs_section() -> list[str]:
    out = ["## Seeded bugs", "",
           "Each is a subclass of a production core overriding one hook "
           "(`model_check/mutants.py`); `sfa-rd2h mutants` must kill every one that is not "
           "marked equivalent.", "", "| bug | rules | defect |", "|---|---|---|"]
    for bug in BUGS:
        doc = " ".join(bug.doc.split())
        if bug.equivalent:
            doc += f" *Equivalent:* {bug.equivalent}"
        out.append(f"| {_bug_label(bug.name, bug.doc)} | {', '.join(bug.rules)} | {doc} |")
    return out + [""]


def generate(tests_dir: Path) -> str:
    """The whole reference, from the live catalog, tables, checker and ``tests_dir``."""
    head = [
        "# The RD2H protocol reference",
        "",
        "<!-- Generated by `sfa-rd2h reference`; do not edit. A test fails when it is "
        "stale. -->",
        "",
        "The rules of the SFA remote device-to-host (RD2H) KV-cache transfer protocol as "
        "this project implements them. Each rule has an ID that code, tests, diagrams and "
        "the model checker cite. For every rule: the transitions of the machine tables "
        "(`statemachines/tables.py`) that cite it, the spec functions that decide it, the "
        "model checker's invariant predicates registered against it "
        "(`model_check/invariants.py`), the seeded bugs that break it "
        "(`model_check/mutants.py`) and the tests whose comments cite it.",
        "",
        "Groups: " + ", ".join(f"[{k} {v}](#{k.lower()}-{_anchor(v)})"
                                for k, v in invariants.GROUPS.items()) + ".",
        "",
    ]
    body = (_rules_section(tests_by_rule(tests_dir)) + _machines_section()
            + _messages_section() + _bugs_section())
    return "\n".join(head + body).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
