// The jobs page (every job the token may see, live) and a job's page (funnel, stage times and their split,
// rewards, failures, throughput over time, nodes, backends, conditions, events, what is in flight (inflight.js),
// its configuration, curves and a search over its trajectories (jobview.js)). Uses dom.js; data from /ui/api.
"use strict";
// one vocabulary with rolloutctl, kubectl and the docs: a finished rollout is scored, agent-failed, infra-failed
// or cancelled (status.counts' keys, shown with their words)
const STAGES = ["queued", "init", "run", "eval", "scored", "agentFailed", "infraFailed", "cancelled"];
const WORDS = {agentFailed: "agent-failed", infraFailed: "infra-failed"};
const word = s => WORDS[s] || s;
const REWARD_MEAN = "the mean reward of the scored and agent-failed rollouts (infra-failed and cancelled ones carry no reward)";

UI.jobsPage = main => {
  const body = UI.el("div", {id: "jobs"});
  UI.replace(main, UI.el("h1", {text: "Rollout jobs"}), body);
  const render = doc => {
    if (!doc.items.length) { UI.replace(body, UI.el("p", {class: "muted", text: "No jobs you may see."})); return; }
    const rows = doc.items.map(j => [
      j.namespace, UI.link(j.name, "jobs", j.namespace, j.name),
      UI.el("span", {class: "phase " + j.phase, text: j.phase}),
      UI.el("span", {class: "progress"}, UI.bar((j.counts.succeeded || 0) + (j.counts.failed || 0), j.counts.total || 0),
            ` ${(j.counts.succeeded || 0) + (j.counts.failed || 0)} / ${j.counts.total || 0}`),
      ...STAGES.map(s => UI.el("span", {"data-stage": s, text: j.counts[s] || 0})),
      UI.fmt(j.rolloutsPerSecond), UI.secs(j.etaSeconds), UI.el("span", {title: REWARD_MEAN, text: UI.fmt(j.rewardMean)}),
      UI.pct(j.infraRate)]);
    UI.replace(body, UI.table(["namespace", "name", "phase", "progress", ...STAGES.map(word), "rollouts/s", "ETA",
                               "reward mean", "infra-failed share"], rows, "jobs"));
    body.dataset.updated = String(Date.now());
  };
  UI.follow("/ui/api/jobs/stream", render);
};

UI.jobPage = (main, ns, name) => {
  const live = UI.el("div", {id: "job"});
  const search = UI.el("section", {id: "search"});
  const inflight = UI.el("section", {id: "inflight-panel"});
  const config = UI.el("section", {id: "config"}), curves = UI.el("section", {id: "curves"});
  UI.replace(main, UI.el("h1", {}, name, UI.el("span", {class: "muted", text: "  namespace " + ns})), config, live, curves,
             inflight, search);
  UI.configPanel(config, ns, name);
  UI.curvesPanel(curves, ns, name);
  UI.inflightPanel(inflight, ns, name);
  UI.follow(`/ui/api/jobs/${encodeURIComponent(ns)}/${encodeURIComponent(name)}/stream`,
            doc => UI.replace(live, ...jobSections(doc)), gone => UI.replace(live, UI.error(String(gone))));
  UI.searchPanel(search, ns, name);
};

function jobSections(doc) {
  const c = doc.status.counts || {};
  const max = Math.max(c.total || 0, 1);
  const funnel = UI.table(["stage", "", "rollouts"], STAGES.map(s => [word(s), UI.bar(c[s] || 0, max, s),
                          UI.el("span", {"data-stage": s, text: c[s] || 0})]), "funnel");
  const head = UI.el("p", {class: "summary"},
    UI.el("span", {class: "phase " + doc.phase, id: "phase", text: doc.phase}),
    ` ${c.total || 0} rollouts · ${UI.fmt(doc.rolloutsPerSecond)} rollouts/s · ETA ${UI.secs(doc.etaSeconds)} · policy version ` +
    `${UI.fmt(doc.status.policyVersion)} · reward mean ${UI.fmt(doc.trajectories ? doc.trajectories.rewardMean : null)} · ` +
    `infra failures ${UI.pct(doc.trajectories ? doc.trajectories.infraRate : null)}`,
    doc.status.message ? UI.el("span", {class: "message", text: " — " + doc.status.message}) : null);
  const out = [head, UI.section("Stages", funnel)];
  if (doc.stages) {
    out.push(UI.section("Stage times (seconds, finished rollouts)", UI.table(["stage", "rollouts", "p50", "p95", "distribution (to p99)"],
      doc.stages.map(s => [s.stage, s.n, UI.fmt(s.p50), UI.fmt(s.p95), spark(s.histogram)]), "stages")));
    const spent = doc.stages.reduce((a, s) => a + (s.seconds || 0), 0);
    out.push(UI.section("Time split across stages (finished rollouts, all together)", UI.table(["stage", "", "seconds", "share"],
      doc.stages.map(s => [s.stage, UI.bar(s.seconds || 0, spent || 1), UI.el("span", {"data-stage-seconds": s.stage, text: UI.fmt(s.seconds, 3)}),
                           UI.pct(spent ? (s.seconds || 0) / spent : null)]), "stage-split")));
    const hmax = Math.max(1, ...doc.rewardHistogram.map(b => b.n));
    out.push(UI.section("Rewards",
      UI.table(["reward", "", "rollouts"], doc.rewardHistogram.map(b => [`${b.lo} – ${b.hi}`, UI.bar(b.n, hmax), b.n]), "histogram"),
      doc.rewardOutOfRange ? UI.el("p", {class: "muted", text: `${doc.rewardOutOfRange} rewards outside [0, 1]`}) : null,
      UI.table(["policy version", "rollouts", "reward mean"], doc.rewardByPolicy.map(p => [p.policyVersion, p.n, UI.fmt(p.mean)]), "policies")));
    const tp = doc.throughput;
    out.push(UI.section("Throughput (rollouts finished" + (tp.bucketSeconds ? ` per ${UI.secs(tp.bucketSeconds)})` : ")"),
      tp.counts.length ? throughputChart(tp) : UI.el("p", {class: "muted", text: "No rollout finished yet."}),
      tp.unplaced ? UI.el("p", {class: "muted", text: `${tp.unplaced} rollouts without an end time`}) : null));
    out.push(UI.section("Failures", doc.failures.length ? UI.table(["kind", "count", "most common reasons"],
      doc.failures.map(f => [f.kind, f.count, UI.el("ul", {}, f.reasons.map(r => UI.el("li", {},
        UI.el("span", {class: "reason", text: r.reason || "(no reason)"}), ` × ${r.count} `,
        r.examples.map(seq => [UI.link("#" + seq, "jobs", doc.namespace, doc.name, "t", seq), " "]))))]), "failures")
      : UI.el("p", {class: "muted", text: "None."})));
  }
  const total = doc.nodesTotal || doc.nodes.length;
  out.push(UI.section("Nodes", doc.nodes.length ? [
    UI.el("p", {class: "node-states"}, `${total} node${total === 1 ? "" : "s"}: ` +
      Object.entries(doc.nodeStates || {}).map(([state, n]) => `${n} ${state}`).join(", "),
      total > doc.nodes.length ? [` — showing the ${doc.nodes.length} that most need a look (not active, then the longest silent); `,
        UI.el("a", {class: "all-nodes", href: `/ui/api/jobs/${encodeURIComponent(doc.namespace)}/${encodeURIComponent(doc.name)}/nodes?limit=1000`,
                    text: "all of them (JSON)"})] : null),
    UI.table(["node", "host", "state", "slot", "in flight", "last beat"],
      doc.nodes.map(n => [n.name, n.host, n.state, UI.fmt(n.slot), UI.el("span", {class: "inflight", text: n.inflight}),
                          UI.secs(n.secondsSinceBeat) + " ago"]), "nodes")]
    : UI.el("p", {class: "muted", text: "No node registered."})));
  if (doc.policy) out.push(policySection(doc.policy));
  if (doc.status.batch) {
    const b = doc.status.batch;
    out.push(UI.section("Batches", UI.table(["current", "state", "informative groups", "target", "completed"],
      [[b.current, b.state, b.counted, b.target, b.completed]], "batch")));
  }
  out.push(UI.section("Backends", UI.table(["url", "healthy", "in flight", "tasks of this job pinned", "admission cap", "reason"],
    doc.backends.map(b => [b.url, b.healthy ? "yes" : "no", b.inflight, b.pinnedToJob, b.admissionCap, b.reason]), "backends")));
  out.push(UI.section("Conditions", UI.table(["type", "status", "reason", "message", "since"],
    (doc.status.conditions || []).map(k => [k.type, k.status, k.reason || "", k.message || "", k.lastTransitionTime || ""]), "conditions")));
  out.push(UI.section("Events", UI.table(["time", "type", "reason", "message"],
    doc.events.slice(-50).reverse().map(e => [e.lastTimestamp || e.time || e.firstTimestamp || "", e.type, e.reason, e.message]), "events")));
  return out;
}

// The job's policy versions and the staleness bound's work (spec.policy; work/staleness.py): each counter also a
// rolloutd_stale_* metric, summed over jobs.
function policySection(p) {
  const spec = p.spec || {}, st = p.staleness || {};
  return UI.section("Policy versions and staleness", UI.el("p", {class: "summary", id: "policy-summary"},
    `version ${UI.fmt(p.version)} · ${(p.history || []).length} announced (${(p.history || []).map(UI.fmt).join(" → ") || "none"}) · ` +
    `update mode ${spec.updateMode || "drain"} · max staleness ${spec.maxStaleness ?? "none"}` +
    (p.paused ? " · paused: a weight update is in progress" : "")),
    UI.table(["counter", "", "meaning"], [
      ["gated", UI.el("span", {"data-counter": "gated", text: st.gated || 0}), "groups not opened by the capacity gate ((S + v + 1) × the batch's groups)"],
      ["cancelled", UI.el("span", {"data-counter": "cancelledRollouts", text: st.cancelledRollouts || 0}), "rollouts in flight cancelled on their daemons at an update (more than S versions behind), run again"],
      ["swept", UI.el("span", {"data-counter": "sweptGroups", text: st.sweptGroups || 0}), "counted groups taken out of the running batch at an update, the batch refilled"],
      ["re-run", UI.el("span", {"data-counter": "rerun", text: st.rerun || 0}), "results that came back more than S versions old, their samples run again with the current policy"]],
    "staleness"));
}

// A stage's distribution as a row of bars (each bar's height: its share of the tallest bin).
function spark(bins) {
  const top = Math.max(1, ...bins.map(b => b.n));
  return UI.el("span", {class: "spark", title: bins.map(b => `≥ ${b.lo} s: ${b.n}`).join("\n")}, bins.map(b => {
    const bar = UI.el("span", {class: "sparkbar"});
    bar.style.height = Math.max(1, Math.round(18 * b.n / top)) + "px";
    return bar;
  }));
}

// Rollouts finished per bucket as an SVG bar chart (no library; attributes only, nothing inline for the CSP).
function throughputChart(tp) {
  const NS = "http://www.w3.org/2000/svg", W = 1000, H = 120, top = Math.max(1, ...tp.counts);
  const svg = (tag, attrs, ...kids) => {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    node.append(...kids);
    return node;
  };
  const w = W / tp.counts.length;
  const when = t => new Date(t * 1000).toLocaleTimeString();
  const bars = tp.counts.map((n, i) => {
    const h = n ? Math.max(1, (H - 14) * n / top) : 0;
    const title = svg("title", {});
    title.textContent = `${when(tp.start + i * tp.bucketSeconds)}: ${n} rollouts (${UI.fmt(n / tp.bucketSeconds)}/s)`;
    return svg("rect", {class: "tpbar", x: i * w + 0.5, y: H - h, width: Math.max(1, w - 1), height: h, "data-n": n}, title);
  });
  const label = (x, anchor, text) => { const t = svg("text", {x, y: 10, "text-anchor": anchor, class: "tplabel"}); t.textContent = text; return t; };
  return svg("svg", {id: "throughput", viewBox: `0 0 ${W} ${H}`, "data-total": tp.total,
                     role: "img", "aria-label": `${tp.total} rollouts finished`},
             ...bars, label(0, "start", `${when(tp.start)} · peak ${top}`),
             label(W, "end", when(tp.start + tp.counts.length * tp.bucketSeconds)));
}
