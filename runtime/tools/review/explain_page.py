"""``sfa-rd2h explain SOURCE``: a failing or real run as a step-through page.

SOURCE is either a checker counterexample (the JSON ``check --counterexample`` writes, or a
list of pinned ones such as ``tests/data/mutant_counterexamples.json`` with ``--bug NAME``)
or a folder of real traces (a demo's ``--trace-dir``, a vLLM run's ``trace_dir``).

A counterexample is replayed: the model checker's ``Cluster`` runs its operations on the
cores of its seeded bug (the correct cores for ``check``'s), recording every process with
the runtime's ``Tracer``, and a ``step`` marker goes into each trace before each operation,
so a step of the page is one operation with every transition and frame it caused. The
invariant that broke marks the last step.

A folder of traces has no common clock: its records are put in one order that respects
causality (a frame's receive comes after its send; each process's records stay in order),
and each transition or frame is one step. ``statemachines.trace.validate`` judges the
traces; its first divergence marks its step.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sfa_rd2h.model_check import mutants
from sfa_rd2h.runtime.tools import sequence
from sfa_rd2h.runtime.tools.review.page import PageError, draw_machine, fill
from sfa_rd2h.spec import invariants as catalog
from sfa_rd2h.statemachines import trace
from sfa_rd2h.statemachines.cores.decode import DecodeCore
from sfa_rd2h.statemachines.cores.prefill import PrefillCore
from sfa_rd2h.statemachines.tables import MACHINES
from sfa_rd2h.statemachines.trace import validate

_STEP_KINDS = ("tr", "msg", "conn")


@dataclass
class _Proc:
    name: str
    file: str
    role: str = ""
    endpoint: str | None = None
    records: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (line, record)


def _read(path: Path) -> _Proc:
    proc = _Proc(path.stem, path.name)
    try:
        numbered = list(trace.records(path))
    except ValueError as exc:
        raise PageError(str(exc)) from None
    for line, rec in numbered:
        if rec.get("k") == "process":
            proc.name = str(rec.get("name", proc.name))
            proc.role = str(rec.get("role", ""))
            proc.endpoint = rec.get("endpoint")
        elif rec.get("k") == "info" and "endpoint" in rec:
            proc.endpoint = rec["endpoint"]
        proc.records.append((line, rec))
    return proc


def _frame(rec: dict[str, Any]) -> str:
    kind = str(rec.get("kind"))
    name = {"read_ready_batch": "READY", "malformed": "malformed frame"}.get(kind, kind.upper())
    return name if rec.get("layer") is None else f"{name} L{rec['layer']}"


def _describe(proc: _Proc, rec: dict[str, Any]) -> str:
    kind = rec.get("k")
    if kind == "tr":
        where = f"{rec.get('m')}[{rec.get('key')}]"
        if rec.get("ev") == "start":
            return f"{proc.name}: {where} starts {rec.get('dst')}"
        return f"{proc.name}: {where} {rec.get('src')} -{rec.get('ev')}-> {rec.get('dst')}"
    if kind == "msg":
        way = "sends" if rec.get("dir") == "send" else "receives"
        return f"{proc.name} {way} {_frame(rec)} ({rec.get('peer')})"
    return f"{proc.name}: connection {rec.get('ev')} to {rec.get('peer')}"


def _flow(proc: _Proc, rec: dict[str, Any]) -> tuple[str, tuple] | None:
    """``(dir, key)`` of a frame: a send and a receive with the same key are the two ends of
    one frame stream (Prefill names the Decode endpoint and its connection identity; Decode
    names that identity as its peer and has the endpoint in its header)."""
    if rec.get("k") != "msg":
        return None
    kind, layer, direction = rec.get("kind"), rec.get("layer"), rec.get("dir")
    if proc.role == "prefill":
        endpoint, conn = rec.get("peer"), rec.get("conn") or rec.get("peer")
        downstream = direction == "send"
    else:
        endpoint, conn = proc.endpoint, rec.get("peer")
        downstream = direction == "recv"
    return str(direction), (endpoint, conn, downstream, kind, layer)


def _arrows(procs: list[_Proc], step_of: dict[tuple[int, int], int]) -> list[list[Any]]:
    """``[send step, send process, receive step, receive process, label]`` per frame whose
    two ends are both traced: the n-th send of a stream is its n-th receive."""
    sends: dict[tuple, deque[tuple[int, int]]] = defaultdict(deque)
    recvs: dict[tuple, deque[tuple[int, int]]] = defaultdict(deque)
    labels: dict[tuple, str] = {}
    for p, proc in enumerate(procs):
        for line, rec in proc.records:
            flow = _flow(proc, rec)
            if flow is None or (p, line) not in step_of:
                continue
            (sends if flow[0] == "send" else recvs)[flow[1]].append((p, line))
            labels[flow[1]] = _frame(rec)
    out = []
    for key, queue in sends.items():
        for (sp, sl), (rp, rl) in zip(queue, recvs.get(key, ()), strict=False):
            out.append([step_of[(sp, sl)], sp, step_of[(rp, rl)], rp, labels[key]])
    return sorted(out)


def _causal_order(procs: list[_Proc]) -> list[tuple[int, int, dict[str, Any]]]:
    """Every step record as ``(process, line, record)``, each process's in its own order
    and every receive after the send it pairs with; processes take turns otherwise."""
    pending: dict[tuple, int] = defaultdict(int)  # sends emitted, not yet received
    sent_total: dict[tuple, int] = defaultdict(int)
    for proc in procs:
        for _, rec in proc.records:
            flow = _flow(proc, rec)
            if flow is not None and flow[0] == "send":
                sent_total[flow[1]] += 1
    queues = [deque((line, rec) for line, rec in proc.records if rec.get("k") in _STEP_KINDS)
              for proc in procs]
    order: list[tuple[int, int, dict[str, Any]]] = []
    while any(queues):
        moved = False
        for p, queue in enumerate(queues):
            while queue:
                line, rec = queue[0]
                flow = _flow(procs[p], rec)
                if flow is not None and flow[0] == "recv" and sent_total[flow[1]] > 0:
                    if pending[flow[1]] == 0:
                        break  # its send is not out yet
                    pending[flow[1]] -= 1
                    sent_total[flow[1]] -= 1
                elif flow is not None and flow[0] == "send":
                    pending[flow[1]] += 1
                queue.popleft()
                order.append((p, line, rec))
                moved = True
                if flow is not None:
                    break  # after a frame, let the other processes catch up
        if not moved:
            # Only a receive whose send is missing from the traces can block everyone;
            # take the first blocked one as it is rather than stop.
            p = next(i for i, q in enumerate(queues) if q)
            line, rec = queues[p].popleft()
            order.append((p, line, rec))
    return order


def _event(p: int, line: int, rec: dict[str, Any]) -> dict[str, Any]:
    keep = {k: rec[k] for k in ("k", "m", "key", "ev", "src", "dst", "a", "dir", "kind",
                                "layer", "peer", "conn") if k in rec}
    return {"p": p, "line": line, **keep}


def _rule(rule_id: str | None) -> dict[str, str] | None:
    rule = catalog.BY_ID.get(rule_id or "")
    return None if rule is None else {"id": rule.id, "text": rule.text}


def _page(title: str, source: str, procs: list[_Proc], steps: list[dict[str, Any]],
          step_of: dict[tuple[int, int], int], failure: dict[str, Any] | None,
          kind: str) -> dict[str, Any]:
    return {
        "kind": kind, "title": title, "source": source,
        "procs": [{"name": p.name, "role": p.role, "file": p.file} for p in procs],
        "steps": steps, "arrows": _arrows(procs, step_of), "failure": failure,
        "machines": {m.name: {**draw_machine(m).as_json(),
                              "rows": [[t.source, t.trigger, t.dest, list(t.conditions),
                                        list(t.unless), list(t.rules)]
                                       for t in m.transitions],
                              "initial": m.initial,
                              "final": sorted(m.final_states)}
                     for m in MACHINES},
    }


# --------------------------------------------------------------------------- traces


def traces_data(folder: Path) -> dict[str, Any]:
    """The page of a folder of real traces."""
    try:
        paths = sequence.trace_files(folder)
    except ValueError as exc:
        raise PageError(str(exc)) from None
    procs = [_read(p) for p in paths]
    steps, step_of = [], {}
    for p, line, rec in _causal_order(procs):
        step_of[(p, line)] = len(steps)
        steps.append({"text": _describe(procs[p], rec), "events": [_event(p, line, rec)],
                      "where": f"{procs[p].file}:{line}"})
    report = validate(paths)
    failure = None
    first = report.divergence
    if first is not None:
        p = next((i for i, path in enumerate(paths) if str(path) == first.path), None)
        at = max((s for (q, line), s in step_of.items() if q == p and line <= first.line),
                 default=len(steps) - 1)
        failure = {"step": max(at, 0), "rule": _rule(first.rule), "rule_id": first.rule,
                   "seen": first.message, "where": f"{Path(first.path).name}:{first.line}",
                   "expected": (_rule(first.rule) or {}).get("text",
                                                            "a trace the machines accept"),
                   "what": "first divergence of the traces (sfa-rd2h validate)"}
    return _page(f"traces in {folder}", str(folder), procs, steps, step_of, failure, "traces")


# --------------------------------------------------------------------------- counterexamples


def pick_counterexample(obj: Any, bug: str | None, source: str) -> dict[str, Any]:
    """The counterexample of a SOURCE file: the object itself, or the entry named ``bug``
    of a list of pinned ones."""
    if isinstance(obj, list):
        names = [e.get("name") for e in obj if isinstance(e, dict)]
        if bug is None and len(obj) == 1:
            obj = obj[0]
        elif bug is None:
            raise PageError(f"{source} holds {len(obj)} counterexamples; choose one with "
                            f"--bug NAME: {', '.join(map(str, names))}")
        else:
            found = [e for e in obj if isinstance(e, dict) and e.get("name") == bug]
            if not found:
                raise PageError(f"{source} has no counterexample of {bug!r}; it has "
                                f"{', '.join(map(str, names))}")
            obj = found[0]
    if not (isinstance(obj, dict) and isinstance(obj.get("scope"), dict)
            and isinstance(obj.get("ops"), list)):
        raise PageError(f"{source} is not a counterexample (an object with 'scope' and "
                        "'ops', as 'sfa-rd2h check --counterexample FILE' writes) nor a "
                        "list of them")
    return obj


def counterexample_data(entry: dict[str, Any], source: str) -> dict[str, Any]:
    """The page of one counterexample, replayed with tracing."""
    from sfa_rd2h.model_check.checker import describe_scope
    from sfa_rd2h.model_check.cluster import Cluster, scope_from_json

    name = entry.get("bug", entry.get("name"))
    bug = None
    if name is not None:
        bug = mutants.BY_NAME.get(str(name))
        if bug is None:
            raise PageError(f"{source}: unknown seeded bug {name!r}; known: "
                            f"{', '.join(mutants.BY_NAME)}")
    try:
        scope = scope_from_json(entry["scope"])
        ops = [tuple(op) for op in entry["ops"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PageError(f"{source}: the counterexample's scope or ops cannot be read: "
                        f"{exc!r}") from None
    texts = [f"deploy {describe_scope(scope)}"]
    error: BaseException | None = None
    with tempfile.TemporaryDirectory(prefix="sfa-rd2h-explain-") as tmp:
        folder = Path(tmp)
        born: dict[str, int] = {}
        try:
            cluster = Cluster(scope, bug.prefill if bug else PrefillCore,
                              bug.decode if bug else DecodeCore, trace_dir=folder)
        except Exception as exc:  # noqa: BLE001 - a deployment that fails is the finding
            raise PageError(f"{source}: the deployment cannot be built: {exc}") from None
        for step, op in enumerate([*ops, None], 1):
            for tracer in cluster.tracers:
                born.setdefault(tracer.path.name, step - 1)
                tracer.info(step=step)
            try:
                if op is None:
                    if cluster.progress_pending():
                        break
                    cluster.check_quiescent()  # what the checker does once nothing can move
                    texts.append("network drained, no timer pending: quiescence holds")
                    continue
                texts.append(cluster.apply(op))
            except Exception as exc:  # noqa: BLE001 - any escape is the counterexample's end
                error = exc
                what = "network drained, no timer pending:" if op is None else \
                    f"{op[0]}{op[1:]}"
                texts.append(f"{what} raised {type(exc).__name__}")
                break
        for tracer in cluster.tracers:
            born.setdefault(tracer.path.name, len(texts) - 1)
        cluster.close_traces()
        procs = [_read(p) for p in sequence.trace_files(folder)]
    steps: list[dict[str, Any]] = [{"text": t, "events": [], "where": f"step {i}"}
                                   for i, t in enumerate(texts)]
    step_of = {}
    for p, proc in enumerate(procs):
        current = born.get(proc.file, 0)
        for line, rec in proc.records:
            if rec.get("k") == "info" and "step" in rec:
                current = int(rec["step"])
            elif rec.get("k") in _STEP_KINDS and current < len(steps):
                step_of[(p, line)] = current
                steps[current]["events"].append(_event(p, line, rec))
    failure = None
    if error is not None:
        rule_id = getattr(error, "rule", None)
        failure = {"step": len(steps) - 1, "rule": _rule(rule_id), "rule_id": rule_id,
                   "seen": f"{type(error).__name__}: {error}", "where": steps[-1]["text"],
                   "expected": (_rule(rule_id) or {}).get("text",
                                                          "no exception from the cores"),
                   "what": "the invariant that broke"}
    if bug is not None:
        title = f"counterexample of the seeded bug {bug.name} ({', '.join(bug.rules)})"
        extra = {"bug": {"name": bug.name, "rules": list(bug.rules),
                         "doc": " ".join(bug.doc.split()),
                         "rule_texts": [_rule(r) for r in bug.rules]}}
    else:
        title, extra = "counterexample of the model checker", {"bug": None}
    page = _page(title, source, procs, steps, step_of, failure, "counterexample")
    page.update(extra, expected_error=entry.get("error"))
    return page


def explain_data(source: Path, bug: str | None = None) -> dict[str, Any]:
    """The page data of SOURCE, a counterexample JSON file or a folder of traces."""
    if source.is_dir():
        return traces_data(source)
    try:
        obj = json.loads(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PageError(f"cannot read {source}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PageError(f"{source} is neither a folder of traces nor JSON: {exc}") from None
    return counterexample_data(pick_counterexample(obj, bug, str(source)), str(source))


def render_html(data: dict[str, Any]) -> str:
    return fill(f"sfa-rd2h explain: {data['title']}", data, "explain.js", "explain")
