// The UI's entry point: who is logged in (and the logout form's csrf field), then the page the path names:
//   /ui/jobs · /ui/jobs/{ns}/{name} · /ui/jobs/{ns}/{name}/t/{seq} · /ui/jobs/{ns}/{name}/logs
//   (jobs.js, trajectory.js, inflight.js)
"use strict";
document.addEventListener("DOMContentLoaded", async () => {
  const main = document.getElementById("main");
  try {
    const me = await UI.getJSON("/ui/api/me");
    document.getElementById("who").textContent = me.name + (me.namespaces.length ? " · " + me.namespaces.join(", ") : "");
    document.getElementById("csrf").value = me.csrf || "";
  } catch (e) { return; }
  const parts = location.pathname.split("/").filter(Boolean).map(decodeURIComponent);  // ui, jobs, ns, name, t, seq
  const crumbs = document.getElementById("crumbs");
  if (parts.length >= 4) crumbs.append(" / ", UI.link(parts[2] + "/" + parts[3], "jobs", parts[2], parts[3]));
  if (parts.length === 6) crumbs.append(" / ", "trajectory " + parts[5]);
  if (parts.length === 5) crumbs.append(" / ", "logs");
  if (parts.length === 2) UI.jobsPage(main);
  else if (parts.length === 4) UI.jobPage(main, parts[2], parts[3]);
  else if (parts.length === 6 && parts[4] === "t") UI.trajectoryPage(main, parts[2], parts[3], parts[5]);
  else if (parts.length === 5 && parts[4] === "logs") UI.logsPage(main, parts[2], parts[3]);
  else UI.replace(main, UI.error("No such page."));
});
