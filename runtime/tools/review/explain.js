"use strict";
// The step-through page: a counterexample or a traced run, one step at a time.
const app = document.getElementById("app");
const steps = DATA.steps;
const failure = DATA.failure;
document.getElementById("subtitle").textContent =
  `${DATA.source}: ${steps.length} steps, ${DATA.procs.length} processes. ` +
  "Arrow keys or the buttons move the cursor; click a row of the sequence to jump there.";

// Table rows of each machine by (source, trigger), in the order the engine tries them.
const tried = {};
for (const [name, m] of Object.entries(DATA.machines)) {
  tried[name] = {};
  m.rows.forEach((row, i) => {
    const key = `${row[0]}|${row[1]}`;
    (tried[name][key] = tried[name][key] || []).push(i);
  });
}

function instanceId(ev) {
  return `${DATA.procs[ev.p].name}/${ev.m}[${ev.key}]`;
}

// Every machine instance's state after step k, and who moved at step k.
function replay(k) {
  const inst = new Map();
  const lastRecv = {};
  let involved = [];
  for (let s = 0; s <= k; s++) {
    const here = [];
    for (const ev of steps[s].events) {
      if (ev.k === "msg" && ev.dir === "recv") lastRecv[ev.p] = {step: s, ev};
      if (ev.k !== "tr") continue;
      const id = instanceId(ev);
      inst.set(id, {id, p: ev.p, m: ev.m, key: ev.key, state: ev.dst, step: s, ev,
                    cause: lastRecv[ev.p] || null});
      if (!here.includes(id)) here.push(id);
    }
    if (here.length) involved = here;  // a step without transitions shows the last ones
  }
  return {inst, involved};
}

function frameText(ev) {
  const layer = ev.layer === undefined ? "" : ` L${ev.layer}`;
  return `${ev.dir} ${ev.kind}${layer} (${ev.peer})`;
}

function eventText(ev) {
  const who = DATA.procs[ev.p].name;
  if (ev.k === "tr") {
    const args = ev.a ? ` args ${JSON.stringify(ev.a)}` : "";
    return ev.ev === "start" ? `${who}: ${ev.m}[${ev.key}] starts in ${ev.dst}`
      : `${who}: ${ev.m}[${ev.key}] ${ev.src} -${ev.ev}-> ${ev.dst}${args}`;
  }
  if (ev.k === "msg") return `${who} ${frameText(ev)}`;
  return `${who}: connection ${ev.ev} ${ev.peer}`;
}

// The rows tried for this transition, in order, and which one fired: the guards it read.
function guardLines(ev) {
  if (ev.ev === "start") return [];
  const rows = DATA.machines[ev.m].rows;
  const order = tried[ev.m][`${ev.src}|${ev.ev}`] || [];
  const fired = order.find((i) => rows[i][2] === ev.dst);
  const out = [];
  for (const i of order) {
    const [, , dest, cond, unless, rules] = rows[i];
    const guards = cond.concat(unless.map((u) => `not ${u}`));
    const text = `${guards.length ? "[" + guards.join(", ") + "]" : "[no guard]"} -> ${dest} (${rules.join(", ")})`;
    if (i === fired) { out.push(el("li", {class: "fired-row"}, el("b", {}, "held: "), text)); break; }
    out.push(el("li", {class: "muted"}, "did not hold: ", text));
  }
  return out;
}

function instanceCard(info, current) {
  const m = DATA.machines[info.m];
  const box = diagram(m.svg);
  const node = stateNode(box, info.state);
  if (node) node.classList.add("current");
  const justFired = info.step === current && info.ev.ev !== "start";
  if (justFired) {
    const rows = tried[info.m][`${info.ev.src}|${info.ev.ev}`] || [];
    const row = rows.find((i) => m.rows[i][2] === info.ev.dst);
    m.edge_rows.forEach((drawn, k) => {
      if (drawn.includes(row)) box.querySelector(`g#e${k}`).classList.add("fired");
    });
  }
  const cause = info.cause ? `${DATA.procs[info.p].name} ${frameText(info.cause.ev)} at step ${info.cause.step}`
    : "no frame received before it (a local step)";
  return el("div", {class: "instance", "data-instance": info.id},
    el("div", {class: "head"}, el("b", {}, info.id), ": ",
      el("span", {class: "inst-state"}, info.state),
      justFired ? ` (just fired ${info.ev.ev} from ${info.ev.src})`
        : ` (since step ${info.step}, ${info.ev.ev === "start" ? "start" : info.ev.ev})`),
    el("div", {class: "muted"}, "message that caused it: ", cause),
    info.ev.a ? el("div", {class: "mono"}, "trigger arguments: ", JSON.stringify(info.ev.a)) : null,
    justFired ? el("ul", {class: "guards"}, guardLines(info.ev)) : null,
    box);
}

// ---------------------------------------------------------------- the sequence diagram
const NS = "http://www.w3.org/2000/svg";
const COL = 110, ROW = 17, TOP = 34, LEFT = 20;
function svgEl(tagName, attrs, text) {
  const node = document.createElementNS(NS, tagName);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function sequence() {
  const width = LEFT + COL * DATA.procs.length + 560;
  const height = TOP + ROW * steps.length + 10;
  const svg = svgEl("svg", {width, height, viewBox: `0 0 ${width} ${height}`, id: "sequence-svg"});
  const defs = svgEl("defs", {});
  const marker = svgEl("marker", {id: "arrow", markerWidth: 8, markerHeight: 8, refX: 7, refY: 3,
                                  orient: "auto"});
  marker.append(svgEl("path", {d: "M0,0 L7,3 L0,6 z", fill: "#204080"}));
  defs.append(marker);
  svg.append(defs);
  const x = (p) => LEFT + COL * p + COL / 2;
  const y = (s) => TOP + ROW * s + ROW / 2;
  steps.forEach((step, s) => {
    const row = svgEl("rect", {x: 0, y: TOP + ROW * s, width, height: ROW, class: "step-row",
                               "data-step": s});
    if (failure && failure.step === s) row.setAttribute("class", "step-row failure-row");
    row.addEventListener("click", () => go(s));
    svg.append(row);
  });
  const cursor = svgEl("rect", {x: 0, y: TOP, width, height: ROW, class: "cursor", id: "cursor"});
  svg.append(cursor);
  DATA.procs.forEach((proc, p) => {
    svg.append(svgEl("text", {x: x(p), y: 14, "text-anchor": "middle", "font-weight": "bold"}, proc.name));
    svg.append(svgEl("text", {x: x(p), y: 26, "text-anchor": "middle", fill: "#666"}, proc.role));
    svg.append(svgEl("line", {x1: x(p), y1: TOP, x2: x(p), y2: height, class: "lifeline"}));
  });
  for (const [s1, p1, s2, p2, label] of DATA.arrows) {
    const line = svgEl("line", {x1: x(p1), y1: y(s1), x2: x(p2), y2: y(s2), "marker-end": "url(#arrow)",
      class: label.includes("FAILED") ? "frame failed" : "frame"});
    svg.append(line);
    svg.append(svgEl("title", {}, label));
  }
  steps.forEach((step, s) => {
    for (const p of new Set(step.events.map((ev) => ev.p))) {
      svg.append(svgEl("circle", {cx: x(p), cy: y(s), r: 3.5, class: "dot"}));
    }
    const text = svgEl("text", {x: LEFT + COL * DATA.procs.length + 8, y: y(s) + 3.5}, `${s}. ${step.text}`);
    text.addEventListener("click", () => go(s));
    svg.append(text);
  });
  return svg;
}

// ---------------------------------------------------------------- layout and cursor
let cursor = 0;
const stepIndex = el("span", {id: "step-index"});
const stepText = el("div", {id: "step-text"});
const stepWhere = el("div", {id: "step-where", class: "muted mono"});
const eventsBox = el("ul", {id: "step-events"});
const instancesBox = el("div", {id: "instances"});
const tableBody = el("tbody", {});
const failureBox = el("div", {id: "failure"});
const seqBox = el("div", {id: "sequence"});

function button(label, id, fn) { return el("button", {id, type: "button", onclick: fn}, label); }
const controls = el("div", {class: "controls"},
  button("first", "first", () => go(0)), button("◀ prev", "prev", () => go(cursor - 1)),
  button("next ▶", "next", () => go(cursor + 1)), button("last", "last", () => go(steps.length - 1)),
  failure ? button(DATA.kind === "traces" ? "divergence" : "broken invariant", "to-failure",
                   () => go(failure.step)) : null,
  stepIndex);

function failurePanel() {
  if (!failure) {
    return el("div", {class: "banner ok", id: "verdict"},
      DATA.kind === "traces" ? "The traces are valid: sfa-rd2h validate finds no divergence."
        : "The run ended without breaking an invariant.");
  }
  const bug = DATA.bug ? el("div", {id: "bug"}, "seeded bug ", el("b", {}, DATA.bug.name),
    ` breaks ${DATA.bug.rules.join(", ")}: ${DATA.bug.doc}`) : null;
  const rule = failure.rule ? el("div", {id: "broken-rule"}, el("b", {class: "rule-id"}, failure.rule.id),
    ": ", el("span", {class: "rule-text"}, failure.rule.text)) : el("div", {id: "broken-rule"},
    el("b", {class: "rule-id"}, failure.rule_id || "no rule"));
  return el("div", {class: "banner bad", id: "verdict"},
    el("div", {}, el("b", {}, `${failure.what}, at step ${failure.step}`), ` (${failure.where})`),
    rule,
    el("div", {}, el("b", {}, "expected: "), el("span", {id: "expected"}, failure.expected)),
    el("div", {}, el("b", {}, "seen: "), el("span", {id: "seen"}, failure.seen)),
    bug);
}

function go(k) {
  cursor = Math.max(0, Math.min(steps.length - 1, k));
  const step = steps[cursor];
  stepIndex.textContent = `step ${cursor} of ${steps.length - 1}`;
  stepText.textContent = step.text;
  stepWhere.textContent = step.where;
  eventsBox.replaceChildren(...(step.events.length ? step.events.map((ev) =>
    el("li", {class: `ev ${ev.k}`, "data-where": `${DATA.procs[ev.p].file}:${ev.line}`},
      eventText(ev), el("span", {class: "muted"}, `  ${DATA.procs[ev.p].file}:${ev.line}`)))
    : [el("li", {class: "muted"}, "no transition and no frame in this step")]));
  const {inst, involved} = replay(cursor);
  instancesBox.replaceChildren(...involved.map((id) => instanceCard(inst.get(id), cursor)));
  tableBody.replaceChildren(...[...inst.values()].map((info) =>
    el("tr", {"data-instance": info.id, class: involved.includes(info.id) ? "involved" : null},
      el("td", {class: "mono"}, info.id), el("td", {class: "state"}, info.state),
      el("td", {}, String(info.step)))));
  failureBox.classList.toggle("here", !!failure && failure.step === cursor);
  const bar = document.getElementById("cursor");
  bar.setAttribute("y", TOP + ROW * cursor);
  const top = TOP + ROW * cursor;
  if (top < seqBox.scrollTop + TOP || top > seqBox.scrollTop + seqBox.clientHeight - 2 * ROW) {
    seqBox.scrollTop = Math.max(0, top - seqBox.clientHeight / 2);
  }
  document.body.dataset.step = String(cursor);
}

document.addEventListener("keydown", (event) => {
  const moves = {ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1};
  if (event.key in moves) { go(cursor + moves[event.key]); event.preventDefault(); }
  else if (event.key === "Home") go(0);
  else if (event.key === "End") go(steps.length - 1);
});

seqBox.append(sequence());
failureBox.append(failurePanel());
app.append(
  el("section", {}, el("h2", {}, "the run"), seqBox),
  el("section", {}, failureBox, controls, stepText, stepWhere,
    el("h3", {}, "what happened in this step"), eventsBox,
    el("h3", {}, "machine instances it moved (state after the step)"), instancesBox,
    el("h3", {}, "every machine instance at this step"),
    el("table", {id: "instance-table"}, el("thead", {}, el("tr", {}, el("th", {}, "instance"),
      el("th", {}, "state"), el("th", {}, "since step"))), tableBody)));
go(0);
