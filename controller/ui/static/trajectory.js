// The trajectory page: the conversation (messages), every turn decoded with the job's tokenizer, the reward
// and its details, the failure, a token view (loss mask, logprob, policy version), the GRPO group side by side,
// copy as JSON and the raw API call. All of it is the model's text: it goes in through UI.el, as text.
"use strict";

UI.trajectoryPage = async (main, ns, name, seq) => {
  let t;
  try {
    t = await UI.getJSON(`/ui/api/jobs/${encodeURIComponent(ns)}/${encodeURIComponent(name)}/trajectories/${encodeURIComponent(seq)}`);
  } catch (e) { UI.replace(main, UI.error(e.message)); return; }
  const json = text => UI.el("pre", {class: "json", text: JSON.stringify(text, null, 2)});
  const copy = UI.el("button", {type: "button", id: "copy", text: "Copy as JSON"});
  copy.addEventListener("click", async () => {
    try { await navigator.clipboard.writeText(JSON.stringify(t.raw, null, 2)); copy.textContent = "Copied"; }
    catch (e) { copy.textContent = "Copy refused by the browser"; }
  });
  const fail = t.failure || {kind: "none", reason: ""};
  const head = UI.el("div", {class: "summary"},
    UI.el("p", {}, "reward ", UI.el("strong", {id: "reward", text: UI.fmt(t.reward, 4)}),
      ` · failure ${fail.kind}` , fail.reason ? UI.el("span", {class: "reason", id: "failure-reason", text: " — " + fail.reason}) : null,
      ` · task ${t.taskId || "—"} · prompt ${t.prompt} · sample ${t.sample} · policy version ${UI.fmt(t.policyVersion)}` +
      ` · finish ${t.finishReason || "—"} · attempt ${t.attempt} · node ${t.node || "—"} · backend ${t.backend || "—"}`),
    UI.el("p", {id: "rollout-links"}, UI.rolloutLinks(t)),
    UI.el("p", {}, copy, " ", UI.el("span", {class: "muted", text: "raw API call: "}),
      UI.el("code", {id: "api", text: `curl -H "Authorization: Bearer $TOKEN" '${location.origin}${t.api}'`})));
  const out = [UI.el("h1", {}, `Trajectory ${t.seq}`), head];
  if (t.messages.length) {
    out.push(UI.section("Conversation", UI.el("ol", {class: "messages"}, t.messages.map(m => UI.el("li", {class: "msg " + m.role},
      UI.el("div", {class: "role", text: m.role}), UI.el("pre", {class: "content", text: m.content}),
      m.toolCalls.length ? json(m.toolCalls) : null)))));
  }
  t.sequences.forEach((s, i) => {
    const title = t.sequences.length > 1 ? `Segment ${i + 1}${s.drift ? " (re-tokenization drift)" : ""}` : "Turns (decoded from the token ids)";
    out.push(UI.section(title,
      UI.el("div", {class: "turn prompt"}, UI.el("div", {class: "role", text: `prompt (${s.promptLength} tokens)`}), UI.el("pre", {text: s.prompt})),
      s.turns.map(turn => UI.el("div", {class: "turn"},
        UI.el("div", {class: "role"}, `assistant, turn ${turn.turn + 1}` + (turn.finishReason ? ` (${turn.finishReason})` : ""),
          turn.modelSeconds !== null && turn.modelSeconds !== undefined ? ` · model call ${UI.fmt(turn.modelSeconds, 3)} s` : "",
          turn.firstTokenSeconds !== null && turn.firstTokenSeconds !== undefined ? [" · first token after ",
            UI.el("span", {class: "ttft", "data-seconds": turn.firstTokenSeconds, text: UI.fmt(turn.firstTokenSeconds, 3)}), " s"] : ""),
        UI.el("pre", {class: "assistant", text: turn.assistant}),
        turn.toolCalls.length ? [UI.el("div", {class: "role", text: "tool calls"}), json(turn.toolCalls)] : null,
        turn.observation ? [UI.el("div", {class: "role", text: "observation"}), UI.el("pre", {class: "observation", text: turn.observation})] : null)),
      tokenView(s.tokenView, t)));
  });
  if (t.tokenizerProblem) out.push(UI.el("p", {class: "muted", text: "Token view without text: " + t.tokenizerProblem}));
  if (t.answer !== undefined && t.answer !== null) out.push(UI.section("Submitted answer", UI.el("pre", {id: "answer", text: String(t.answer)})));
  out.push(UI.section("Reward details", json(t.rewardDetails || {})));
  out.push(UI.section("GRPO group", UI.table(["sample", "reward", "advantage", "failure", ""], t.group.map(g => [
    g.sample, UI.fmt(g.reward, 4), UI.fmt(g.advantage, 4), g.failure,
    String(g.seq) === String(t.seq) ? UI.el("strong", {text: "this one"}) : UI.link("open", "jobs", ns, name, "t", g.seq)]), "group")));
  if (t.waterfall) out.push(UI.section("Waterfall (seconds from queueing)", UI.waterfall(t.waterfall)));
  out.push(UI.section("Timings (seconds)", json(t.timings || {})));
  UI.replace(main, ...out);
};

// A trained-on token's background: hue 120·p (green when likely, red when not), lighter as p falls.
function lpColour(logprob) {
  const p = Math.exp(Math.max(logprob, -20));
  return `hsl(${Math.round(120 * p)}, 65%, ${Math.round(88 - 20 * p)}%)`;
}

function tokenView(view, t) {
  // each trained-on token's background is its sampling probability p = exp(logprob): green (p near 1, likely) through
  // yellow to light red (p near 0, unlikely); the swatches below are painted by the same function
  const swatch = (lp, text) => { const s = UI.el("span", {class: "tok m1 lp-key", "data-logprob": lp, text}); s.style.backgroundColor = lpColour(lp); return s; };
  const legend = UI.el("p", {class: "muted", id: "token-legend"}, "Tokens: ", UI.el("span", {class: "tok m0", text: "context (mask 0, not trained on)"}),
    " · trained on (mask 1), coloured by the sampling probability: ", swatch(0, "p = 1 (logprob 0)"), " ",
    swatch(Math.log(0.5), "p = 0.5"), " ", swatch(Math.log(0.05), "p = 0.05 (low logprob)"), " · no logprob recorded: ",
    UI.el("span", {class: "tok m1", text: "plain"}),
    ` · policy version ${UI.fmt(t.policyVersion)}` +
    (t.policyVersions && t.policyVersions.length > 1 ? ` (versions in this rollout: ${t.policyVersions.join(", ")})` : "") +
    (view.versions && view.versions.length > 1 ? ` · underline colour = the version that sampled the token ` +
      `(${view.versions.map(UI.fmt).join(" → ")}; a weight update landed mid-turn)` : "") +
    (view.truncated ? ` · first ${view.tokens.length} of ${view.length} tokens` : ""));
  const hue = v => 40 + 100 * (view.versions || []).indexOf(v);
  const box = UI.el("div", {class: "tokens"});
  for (const k of view.tokens) {
    const span = UI.el("span", {class: "tok " + (k.mask === 1 ? "m1" : "m0"),
      title: `#${k.i} id ${k.id} · mask ${k.mask === null ? "—" : k.mask} · logprob ${k.logprob === null ? "—" : k.logprob}` +
        ("version" in k ? ` · version ${UI.fmt(k.version)}` : "")}, k.text);
    if ("version" in k && view.versions.length > 1) span.style.borderBottom = `3px solid hsl(${hue(k.version)}, 70%, 40%)`;
    if (k.mask === 1 && typeof k.logprob === "number") span.style.backgroundColor = lpColour(k.logprob);
    box.append(span);
  }
  return UI.el("details", {class: "tokenview"}, UI.el("summary", {text: `Token view (${view.length} tokens)`}), legend, box);
}
