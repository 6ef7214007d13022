// The job page's deeper views: the config panel (the spec as written, secrets redacted), reward, pass-rate,
// response-length, turn, tool-error and truncation curves per policy version and over time, pass rates per prompt, zero-variance groups (refreshed every 10 s),
// and the trajectories table: filters and sort kept in the page's URL (a link shares the view), sortable headers.
// Uses dom.js; data from /ui/api/jobs/{ns}/{name}/config, …/curves, …/trajectories (ui/jobview.py).
"use strict";

const jobBase = (ns, name) => `/ui/api/jobs/${encodeURIComponent(ns)}/${encodeURIComponent(name)}`;

// {a: 1, b: null, c: [2]} as "a 1 · c [2]" (unset ones left out)
const pairs = o => Object.entries(o || {}).filter(([, v]) => v !== null && !(Array.isArray(v) && !v.length))
  .map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`).join(" · ") || "defaults";

UI.configPanel = async (section, ns, name) => {
  let doc;
  try { doc = await UI.getJSON(jobBase(ns, name) + "/config"); } catch (e) { UI.replace(section, UI.error(e.message)); return; }
  const s = doc.spec, llm = s.llm || {}, agent = s.agent || {}, tasks = s.tasks || {};
  const facts = [["model", llm.model || "(discovered from the backend)"], ["tokenizer", llm.tokenizer || "—"],
    ["backends", (llm.backends || []).map(b => b.url).join(", ") || "—"], ["tasks", `${tasks.kind || "—"} · ${tasks.source || "—"}`],
    ["samples per prompt", s.samplesPerPrompt ?? "—"], ["agent", `${agent.kind || "loop"} · max turns ${agent.maxTurns ?? "—"}`],
    ["tools", (agent.tools || []).map(t => typeof t === "string" ? t : (t.name || JSON.stringify(t))).join(", ") || "—"],
    ["sampling", pairs(agent.sampling)], ["policy", pairs(s.policy)]];
  UI.replace(section, UI.el("h2", {text: `Configuration (generation ${UI.fmt(doc.generation)})`}),
    UI.el("dl", {class: "config-facts"}, facts.map(([k, v]) => [UI.el("dt", {text: k}), UI.el("dd", {text: v})])),
    UI.el("details", {}, UI.el("summary", {text: "The whole spec, as written (secrets redacted)"}),
      UI.el("pre", {id: "config-spec", class: "json", text: JSON.stringify({metadata: doc.metadata, spec: s}, null, 2)})));
};

// One line chart (an SVG, attributes only): `series` [{name, cls, points: [[x, y]]}], y in [0, 1] unless given.
function lineChart(id, series, xLabel, xs) {
  const NS = "http://www.w3.org/2000/svg", W = 600, H = 150, L = 34, B = 20;
  const svg = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
    if (text !== undefined) n.textContent = text;
    return n;
  };
  const all = series.flatMap(s => s.points.map(p => p[1])).filter(y => y !== null);
  const lo = Math.min(0, ...all), hi = Math.max(1, ...all), n = Math.max(1, xs.length - 1);
  const X = i => L + (W - L - 8) * (xs.length === 1 ? 0.5 : i / n), Y = y => 6 + (H - B - 6) * (hi - y) / (hi - lo || 1);
  const root = svg("svg", {id, class: "curve", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": xLabel});
  for (const y of [lo, (lo + hi) / 2, hi]) {
    root.append(svg("line", {class: "grid", x1: L, x2: W - 8, y1: Y(y), y2: Y(y)}),
                svg("text", {class: "axis", x: L - 4, y: Y(y) + 3, "text-anchor": "end"}, UI.fmt(y, 2)));
  }
  root.append(svg("text", {class: "axis", x: L, y: H - 4}, `${xLabel}: ${xs[0]}`),
              svg("text", {class: "axis", x: W - 8, y: H - 4, "text-anchor": "end"}, String(xs[xs.length - 1])));
  for (const s of series) {
    const pts = s.points.filter(p => p[1] !== null);
    root.append(svg("polyline", {class: "line " + s.cls, points: pts.map(([i, y]) => `${X(i)},${Y(y)}`).join(" ")}));
    for (const [i, y] of pts) {
      const dot = svg("circle", {class: "dot " + s.cls, cx: X(i), cy: Y(y), r: 3, "data-x": xs[i], "data-y": y});
      dot.append(svg("title", {}, `${s.name} at ${xs[i]}: ${UI.fmt(y, 4)}`));
      root.append(dot);
    }
  }
  const legend = UI.el("p", {class: "legend"}, series.map(s => [UI.el("span", {class: "key " + s.cls}), ` ${s.name}  `]));
  return [root, legend];
}

UI.curvesPanel = (section, ns, name) => {
  const render = c => {
    const pol = c.byPolicy, ot = c.overTime;
    const curve = (rows, idx) => [{name: "reward mean", cls: "reward", points: rows.map((r, i) => [idx(i), r.rewardMean])},
                                  {name: `pass rate (reward ≥ ${c.passAt})`, cls: "pass", points: rows.map((r, i) => [idx(i), r.passRate])}];
    // the length curves, one chart each (their scales differ): [id suffix, series [name, cls, field]]
    const lengths = [["length", [["generated tokens (mean)", "generated", "generatedMean"]]],
                     ["turns", [["turns (mean)", "turns", "turnsMean"]]],
                     ["rates", [["tool-error rate", "tool-errors", "toolErrorRate"], ["truncation rate", "truncated", "truncationRate"]]]];
    const lengthCharts = (prefix, rows, xLabel, xs) => lengths.map(([id, series]) => lineChart(`${prefix}-${id}`,
      series.map(([nm, cls, f]) => ({name: nm, cls, points: rows.map((r, i) => [i, r[f] ?? null])})), xLabel, xs));
    const when = b => new Date((ot.start + b * ot.bucketSeconds) * 1000).toLocaleTimeString();
    const out = [UI.el("h2", {text: "Reward and pass rate"})];
    const versions = pol.map(p => UI.fmt(p.policyVersion));
    out.push(pol.length ? UI.el("div", {class: "chart", id: "by-policy"}, UI.el("h3", {text: "per policy version"}),
      lineChart("curve-policy", curve(pol, i => i), "policy version", versions),
      UI.table(["policy version", "versions behind now", "rollouts", "reward mean", "pass rate", "generated tokens", "turns",
        "tool-error rate", "truncation rate"], pol.map(p => [UI.fmt(p.policyVersion), UI.fmt(p.behind), p.n, UI.fmt(p.rewardMean),
        UI.pct(p.passRate), UI.fmt(p.generatedMean), UI.fmt(p.turnsMean), UI.pct(p.toolErrorRate), UI.pct(p.truncationRate)]),
        "policy-curve")) : UI.el("p", {class: "muted", text: "No scored rollout yet."}));
    let timeRows = [], timeXs = [];
    if (ot.points.length) {
      const byBucket = new Map(ot.points.map(p => [p.bucket, p]));
      const last = ot.points[ot.points.length - 1].bucket;
      for (let b = 0; b <= last; b++) { timeXs.push(when(b)); timeRows.push(byBucket.get(b) || {rewardMean: null, passRate: null}); }
      out.push(UI.el("div", {class: "chart", id: "over-time"}, UI.el("h3", {text: `over time (per ${UI.secs(ot.bucketSeconds)}, by end time)`}),
        lineChart("curve-time", curve(timeRows, i => i), "time", timeXs)));
    }
    if (pol.length) {
      out.push(UI.el("h2", {text: "Response length, turns, tool errors and truncation"}),
        UI.el("div", {class: "chart", id: "length-by-policy"}, UI.el("h3", {text: "per policy version"}),
          lengthCharts("curve-policy", pol, "policy version", versions)));
      if (timeRows.length) out.push(UI.el("div", {class: "chart", id: "length-over-time"},
        UI.el("h3", {text: `over time (per ${UI.secs(ot.bucketSeconds)}, by end time)`}), lengthCharts("curve-time", timeRows, "time", timeXs)));
    }
    const pr = c.prompts, zv = c.zeroVariance;
    out.push(UI.el("h3", {text: `Pass rate per prompt: ${pr.passed} of ${pr.total} prompts passed at least once`}),
      UI.el("details", {}, UI.el("summary", {text: `the ${pr.items.length} hardest first`}),
        UI.table(["prompt", "task", "rollouts", "passed", "pass rate", "reward mean"], pr.items.map(p => [p.prompt, p.taskId || "",
          p.n, p.passed, UI.pct(p.passRate), UI.fmt(p.rewardMean)]), "prompt-pass")));
    out.push(UI.el("h3", {}, "Zero-variance groups: ", UI.el("span", {id: "zero-variance-count", text: zv.count}),
      ` of ${zv.completeGroups} complete groups (every sample the same reward: no signal for GRPO)`),
      zv.items.length ? UI.table(["prompt", "task", "group", "samples", "reward", "first trajectory"], zv.items.map(g => [g.prompt,
        g.taskId || "", UI.fmt(g.group), g.n, UI.fmt(g.reward), UI.link("#" + g.seq, "jobs", ns, name, "t", g.seq)]), "zero-variance") : null);
    UI.replace(section, ...out);
    section.dataset.updated = String(Date.now());
  };
  const tick = async () => {
    if (!document.body.contains(section)) return;
    try { render(await UI.getJSON(jobBase(ns, name) + "/curves")); } catch (e) { UI.replace(section, UI.error(e.message)); }
    setTimeout(tick, 10000);
  };
  tick();
};

// The trajectories table. The filters and the sort live in the page's query string (?failure=agent&sort=-reward):
// reloading or sharing the URL shows the same view.
const FILTERS = ["rewardMin", "rewardMax", "failure", "task", "q"];
const COLUMNS = [["seq", "seq"], ["task"], ["prompt"], ["sample"], ["reward", "reward"], ["failure"], ["reason"],
                 ["policy"], ["tokens"], ["generated"], ["turns"], ["seconds", "duration"]];

UI.searchPanel = (section, ns, name) => {
  const url = new URLSearchParams(location.search);
  const input = (label, nm, type) => UI.el("label", {}, label + " ", UI.el("input", {name: nm, type: type || "text", step: "any", value: url.get(nm) || ""}));
  const kind = UI.el("select", {name: "failure"}, ["", "none", "agent", "infra", "config"].map(k => UI.el("option", {value: k, text: k || "any",
    selected: (url.get("failure") || "") === k ? "selected" : null})));
  const results = UI.el("div", {id: "results"});
  const more = UI.el("button", {type: "button", hidden: "hidden", text: "More"});
  const form = UI.el("form", {id: "filter"}, input("reward ≥", "rewardMin", "number"), input("reward ≤", "rewardMax", "number"),
    UI.el("label", {}, "failure ", kind), input("task id", "task"), input("text", "q"), UI.el("button", {type: "submit", text: "Search"}));
  let sort = url.get("sort") || "seq", offset = 0, rows = [];
  const params = () => {
    const p = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v !== "" && FILTERS.includes(k)) p.set(k, v);
    if (sort !== "seq") p.set("sort", sort);
    return p;
  };
  const header = ([label, key]) => {
    if (!key) return label;
    const on = sort.replace("-", "") === key, arrow = on ? (sort.startsWith("-") ? " ▼" : " ▲") : "";
    return UI.el("a", {href: "#", class: "sort" + (on ? " on" : ""), "data-sort": key, text: label + arrow,
      onclick: e => { e.preventDefault(); sort = on && !sort.startsWith("-") ? "-" + key : key; restart(); }});
  };
  const load = async () => {
    const p = params();
    p.set("offset", offset);
    try {
      const page = await UI.getJSON(jobBase(ns, name) + "/trajectories?" + p);
      rows = rows.concat(page.items.map(t => [UI.link("#" + t.seq, "jobs", ns, name, "t", t.seq), t.taskId || "", t.prompt, t.sample,
        UI.fmt(t.reward), t.failure, UI.el("span", {class: "reason", text: t.reason}), UI.fmt(t.policyVersion), UI.fmt(t.tokens),
        UI.fmt(t.generatedTokens), UI.fmt(t.turns), UI.fmt(t.seconds)]));
      const table = UI.el("table", {class: "trajectories"}, UI.el("thead", {}, UI.el("tr", {}, COLUMNS.map(c => UI.el("th", {}, header(c))))),
        UI.el("tbody", {}, rows.map(r => UI.el("tr", {}, r.map(c => UI.el("td", {}, c))))));
      UI.replace(results, rows.length ? table : [UI.el("table", {class: "trajectories"}, UI.el("thead", {}, UI.el("tr", {},
        COLUMNS.map(c => UI.el("th", {}, header(c)))))), UI.el("p", {class: "muted", text: "No trajectory matches."})]);
      results.dataset.query = String(params());
      offset = page.next ?? offset;
      more.hidden = page.next === null;
    } catch (e) { UI.replace(results, UI.error(e.message)); }
  };
  const restart = () => {
    const q = String(params());
    history.replaceState(null, "", location.pathname + (q ? "?" + q : ""));
    offset = 0; rows = []; load();
  };
  form.addEventListener("submit", e => { e.preventDefault(); restart(); });
  more.addEventListener("click", load);
  UI.replace(section, UI.el("h2", {text: "Trajectories"}), form, results, more);
  load();
};
