"use strict";
// The review page: what a change of the spec snapshot does to each machine.
const app = document.getElementById("app");
document.getElementById("subtitle").textContent =
  `old: ${DATA.old}  →  new: ${DATA.new}. Green: added; red, dashed: removed; ` +
  "amber: changed (guards, effects or rule IDs). Click a transition or a state.";

const details = el("aside", {id: "details"});
const sections = {};

function rulesOf(machine, rows) {
  return [...new Set(rows.flatMap((i) => machine.rows[i].rules))].sort();
}

function ruleBlocks(ids) {
  if (!ids.length) return [el("p", {class: "muted"}, "cites no rule")];
  return ids.map((id) => DATA.rules[id] ? ruleBlock(id, DATA.rules[id])
    : el("div", {class: "rule", "data-rule": id}, el("b", {}, id), " is not in either catalog"));
}

function rowBlock(machine, i) {
  const row = machine.rows[i];
  const lines = [];
  if (row.status === "changed") {
    lines.push(el("div", {class: "mono"}, "old: ", row.old), el("div", {class: "mono"}, "new: ", row.new));
  } else if (row.old && !row.new) {
    lines.push(el("div", {class: "mono"}, "old: ", row.old), el("div", {class: "muted"}, "new: (none)"));
  } else if (row.new && !row.old) {
    lines.push(el("div", {class: "muted"}, "old: (none)"), el("div", {class: "mono"}, "new: ", row.new));
  } else {
    lines.push(el("div", {class: "mono"}, "both: ", row.new));
  }
  return el("div", {class: "row-detail", "data-row": i}, tag(row.status), ...lines);
}

function select(machine, g) {
  for (const other of document.querySelectorAll(".diagram g.selected")) other.classList.remove("selected");
  if (g) g.classList.add("selected");
}

function showRows(machine, rows, g) {
  select(machine, g);
  const tests = DATA.tests_found ? [] : [el("p", {class: "muted"}, "no tests/ folder: tests not listed")];
  details.replaceChildren(
    el("h2", {}, `${machine.name}: ${rows.length > 1 ? rows.length + " rows" : "transition"}`),
    ...rows.map((i) => rowBlock(machine, i)),
    el("h2", {}, "rules cited"), ...tests, ...ruleBlocks(rulesOf(machine, rows)));
}

function showState(machine, name, g) {
  select(machine, g);
  const state = machine.states.find((s) => s.name === name);
  const rows = machine.rows.map((r, i) => [r, i]).filter(([r]) => r.source === name || r.dest === name)
    .map(([, i]) => i);
  details.replaceChildren(
    el("h2", {}, `${machine.name}: state ${name}`), tag(state.status),
    el("div", {class: "state-doc", html: state.diff || escapeHtml(state.new ?? state.old)}),
    state.status === "changed" ? el("div", {class: "muted"}, "old: ", state.old) : null,
    el("h3", {}, "rows from or to it"), ...rows.map((i) => rowBlock(machine, i)),
    el("h2", {}, "rules cited"), ...ruleBlocks(rulesOf(machine, rows)));
}

function changeList() {
  const box = el("section", {id: "changes", class: "changes"}, el("h2", {}, "changes"));
  if (!DATA.changes.length) {
    box.append(el("div", {id: "unchanged", class: "banner ok"},
      "No protocol changes: the two snapshots have the same machines, messages and rules."));
    return box;
  }
  for (const machine of DATA.machines) {
    const items = [];
    machine.rows.forEach((row, i) => {
      if (!row.status) return;
      const k = machine.edge_rows.findIndex((rows) => rows.includes(i));
      items.push(el("li", {class: "clickable", "data-machine": machine.name, "data-row": i,
        onclick: () => showRows(machine, [i], sections[machine.name].querySelector(`g#e${k}`))},
        tag(row.status), el("code", {}, row.new || row.old)));
    });
    for (const state of machine.states) {
      if (state.status) items.push(el("li", {}, tag(state.status), "state ", el("code", {}, state.name)));
    }
    if (items.length || machine.status) {
      box.append(el("h3", {}, machine.name, " ", tag(machine.status)), el("ul", {}, items));
    }
  }
  const rules = Object.entries(DATA.rules).filter(([, r]) => r.status);
  if (rules.length) {
    box.append(el("h3", {}, "rules"), el("ul", {}, rules.map(([id, r]) => el("li", {"data-rule": id},
      tag(r.status), el("b", {}, id), ": ", el("span", {class: "rule-text", html: r.diff || escapeHtml(r.text)})))));
  }
  if (DATA.wire.length) {
    box.append(el("h3", {}, "wire messages"), el("ul", {}, DATA.wire.map((w) => el("li", {"data-message": w.name},
      tag(w.status), el("b", {}, w.name), ": ", el("span", {class: "mono", html: w.diff})))));
  }
  box.append(el("h3", {}, "as sfa-rd2h spec diff prints it"),
    el("pre", {class: "mono", id: "spec-diff"}, DATA.changes.join("\n")));
  return box;
}

function machineSection(machine) {
  const box = el("section", {class: "machine", id: `machine-${machine.name}`},
    el("h2", {}, machine.name, " ", tag(machine.status)));
  const drawing = diagram(machine.svg);
  for (const g of drawing.querySelectorAll("g.row")) {
    const k = Number(g.id.slice(1));
    g.addEventListener("click", () => showRows(machine, machine.edge_rows[k], g));
  }
  for (const g of drawing.querySelectorAll("g.state")) {
    g.addEventListener("click", () => showState(machine, g.id.slice(2), g));
  }
  box.append(drawing);
  sections[machine.name] = box;
  return box;
}

const diagrams = el("div", {id: "diagrams"}, DATA.machines.map(machineSection));
details.append(el("h2", {}, "details"),
  el("p", {class: "muted"}, "Click a transition or a state of a diagram, or a change in the list."));
app.append(changeList(), diagrams, details);
