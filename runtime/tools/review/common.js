"use strict";
// Shared by both pages: the page's data, DOM building, and the generated machine SVGs.
const DATA = JSON.parse(document.getElementById("page-data").textContent);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "html") node.innerHTML = value;  // only for HTML the generator escaped
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function tag(status) {
  return status ? el("span", {class: `tag ${status}`}, status) : null;
}

// A fresh copy of a machine's SVG inside a .diagram element.
function diagram(svgText) {
  const box = el("div", {class: "diagram"});
  box.innerHTML = svgText;
  return box;
}

function stateNode(box, name) {
  return box.querySelector(`g.state[id="s_${CSS.escape(name)}"]`);
}

function list(items, empty) {
  if (!items.length) return el("span", {class: "muted"}, empty);
  return el("ul", {}, items.map((item) => el("li", {}, el("code", {}, item))));
}

function ruleBlock(id, rule) {
  // One rule with what keeps it: the same facts `sfa-rd2h reference` writes.
  return el("div", {class: "rule", "data-rule": id},
    el("div", {}, el("b", {}, id), " ", tag(rule.status)),
    el("div", {class: "rule-text", html: rule.diff || escapeHtml(rule.text)}),
    rule.predicates ? el("h3", {}, "judged by the checker's predicates") : null,
    rule.predicates ? list(rule.predicates, "none") : null,
    rule.bugs ? el("h3", {}, "broken by the seeded bugs") : null,
    rule.bugs ? list(rule.bugs, "none") : null,
    rule.tests ? el("h3", {}, "exercised by the tests") : null,
    rule.tests ? list(rule.tests, "none") : null);
}

function escapeHtml(text) {
  const div = document.createElement("div");
  div.textContent = text;
  return div.innerHTML;
}
