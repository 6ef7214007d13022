// DOM helpers for the UI's pages. Every piece of data goes in as text (textContent, attribute values set one
// by one), never as markup: a trajectory's text is the model's and may hold <script> or a javascript: link.
"use strict";
const UI = {};

UI.el = (tag, attrs, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
};

// A link inside the UI, built from parts that are each URL-encoded.
UI.link = (text, ...parts) => UI.el("a", {href: "/ui/" + parts.map(p => encodeURIComponent(String(p))).join("/")}, text);

UI.fmt = (x, digits = 3) => (x === null || x === undefined) ? "—" : (typeof x === "number" ? String(+x.toFixed(digits)) : String(x));
UI.pct = x => (x === null || x === undefined) ? "—" : (100 * x).toFixed(1) + "%";
UI.secs = s => {
  if (s === null || s === undefined) return "—";
  if (s < 90) return s.toFixed(1) + " s";
  if (s < 5400) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
};

UI.table = (headers, rows, cls) => UI.el("table", {class: cls || null},
  UI.el("thead", {}, UI.el("tr", {}, headers.map(h => UI.el("th", {text: h})))),
  UI.el("tbody", {}, rows.map(r => UI.el("tr", {}, r.map(c => UI.el("td", {}, c))))));

UI.section = (title, ...body) => UI.el("section", {}, UI.el("h2", {text: title}), ...body);

UI.bar = (value, max, cls) => {
  const outer = UI.el("div", {class: "bar " + (cls || "")});
  const inner = UI.el("div", {class: "fill"});
  inner.style.width = (max > 0 ? Math.min(100, 100 * value / max) : 0) + "%";
  outer.append(inner);
  return outer;
};

UI.getJSON = async url => {
  const r = await fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}});
  if (r.status === 401) { location.assign("/ui/login"); throw new Error("not logged in"); }
  const body = await r.json();
  if (!r.ok) throw new Error(body.detail || r.statusText);
  return body;
};

// Follows a server-sent event stream; `render` gets each JSON document.
UI.follow = (url, render, onGone) => {
  const source = new EventSource(url);
  source.onmessage = e => render(JSON.parse(e.data));
  source.addEventListener("gone", e => { source.close(); if (onGone) onGone(JSON.parse(e.data)); });
  window.addEventListener("pagehide", () => source.close());
  return source;
};

UI.replace = (parent, ...children) => { parent.replaceChildren(...children.flat().filter(c => c)); };

UI.error = message => UI.el("p", {class: "error", text: message});
