// The job page's "In flight" panel (every leased rollout: stage, turn, time in stage, node, backend, stalled
// first and flagged), refreshed every 2 s while the page is open, and the trajectory page's waterfall (stages,
// waits and turns on a time axis: model vs tool vs waiting). Uses dom.js; data from /ui/api.
"use strict";

UI.inflightPanel = (section, ns, name) => {
  const url = `/ui/api/jobs/${encodeURIComponent(ns)}/${encodeURIComponent(name)}/inflight`;
  const body = UI.el("div", {id: "inflight"});
  UI.replace(section, UI.el("h2", {text: "In flight"}), body);
  const render = doc => {
    const head = UI.el("p", {class: "summary"}, `${doc.total} in flight · ` +
      Object.entries(doc.stages).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ") + ` · `,
      UI.el("span", {id: "stalled-count", class: doc.stalled ? "stalled" : "", text: `${doc.stalled} stalled`}),
      ` (in one stage or unheard for ${UI.secs(doc.stalledAfterSeconds)} or more)` +
      (doc.truncated ? ` · the first ${doc.items.length} shown, stalled first` : ""));
    const rows = doc.items.map(r => {
      const row = [r.attemptId, UI.el("span", {class: "stage", text: r.stage}), r.turn === null ? "—" : r.turn,
        UI.el("span", {class: "in-stage", "data-seconds": r.inStageSeconds, text: UI.secs(r.inStageSeconds)}),
        UI.secs(r.sinceHeartbeatSeconds) + " ago", r.node, r.backend || "—", r.attempt,
        r.stalled ? UI.el("strong", {class: "stalled", text: "stalled"}) : "", UI.rolloutLinks(r)];
      return row;
    });
    UI.replace(body, head, doc.items.length ? UI.table(["rollout", "stage", "turn", "in stage", "last beat", "node",
      "backend", "attempt", "", "trace · logs"], rows, "inflight-rows") : UI.el("p", {class: "muted", text: "Nothing in flight."}));
    body.dataset.updated = String(Date.now());
  };
  let stop = false;
  const tick = async () => {
    if (stop || !document.body.contains(section)) return;
    try { render(await UI.getJSON(url)); } catch (e) { UI.replace(body, UI.error(e.message)); }
    setTimeout(tick, 2000);
  };
  tick();
  return () => { stop = true; };
};

// A rollout's links: its trace in the OTLP backend's UI (ROLLOUTD_TRACE_URL, when set and tracing is on) and its
// node's log lines for the attempt (the UI's logs page). `r`: {traceUrl, traceId, logsUrl}.
UI.rolloutLinks = r => UI.el("span", {class: "links"},
  r.traceUrl ? UI.el("a", {class: "trace-link", href: r.traceUrl, target: "_blank", rel: "noopener noreferrer", text: "trace"})
             : UI.el("span", {class: "muted", title: r.traceId ? "set ROLLOUTD_TRACE_URL for a link" : "tracing is off (ROLLOUTD_TRACING=1)",
                              text: r.traceId ? "trace " + r.traceId.slice(0, 8) + "…" : "no trace"}),
  " · ", r.logsUrl ? UI.el("a", {class: "logs-link", href: r.logsUrl, text: "logs"}) : UI.el("span", {class: "muted", text: "no logs"}));

// One attempt's lines in its node's log (/ui/jobs/{ns}/{name}/logs?node=…&attempt=…&trace=…), as text.
UI.logsPage = async (main, ns, name) => {
  const q = new URLSearchParams(location.search);
  const what = q.get("attempt") ? `rollout ${q.get("attempt")}` : "the node";
  UI.replace(main, UI.el("h1", {text: `Logs of ${what} on node ${q.get("node") || "?"}`}), UI.el("p", {class: "muted", text: "Loading…"}));
  let doc;
  try { doc = await UI.getJSON(`/ui/api/jobs/${encodeURIComponent(ns)}/${encodeURIComponent(name)}/logs?${q}`); }
  catch (e) { UI.replace(main, UI.el("h1", {text: `Logs of ${what}`}), UI.error(e.message)); return; }
  UI.replace(main, UI.el("h1", {text: `Logs of ${what} on node ${doc.node}`}),
    UI.el("p", {class: "muted"}, `${doc.matched} of the node's last ${doc.read} lines` +
      (doc.needles.length ? ` name ${doc.needles.join(" or ")}` : "") + " · ", UI.rolloutLinks({...doc, logsUrl: null})),
    UI.el("pre", {id: "log-lines", text: doc.lines.join("\n") || "(no line)"}));
};

// A finished rollout on a time axis: one row per bar, its left edge and width a share of the whole.
UI.waterfall = w => {
  const total = Math.max(w.total, 1e-9);
  const rows = w.bars.map(b => {
    const bar = UI.el("span", {class: "wf " + b.kind});
    bar.style.marginLeft = (100 * b.start / total).toFixed(3) + "%";
    bar.style.width = Math.max(0.2, 100 * b.seconds / total).toFixed(3) + "%";
    return UI.el("div", {class: "wfrow", "data-kind": b.kind, "data-label": b.label, "data-seconds": b.seconds},
      UI.el("span", {class: "wflabel", text: b.label}), UI.el("span", {class: "wftrack"}, bar),
      UI.el("span", {class: "wfsecs", text: `${UI.fmt(b.seconds, 3)} s at ${UI.fmt(b.start, 3)} s`}));
  });
  const s = w.split;
  const split = UI.el("p", {class: "muted", id: "waterfall-split"}, `queue ${UI.fmt(s.queue, 3)} s · init ${UI.fmt(s.init, 3)} s · ` +
    `model ${UI.fmt(s.model, 3)} s · tools ${UI.fmt(s.tool, 3)} s · rest of run ${UI.fmt(s.otherRun, 3)} s · eval ${UI.fmt(s.eval, 3)} s`);
  return UI.el("div", {id: "waterfall"}, split, rows);
};
