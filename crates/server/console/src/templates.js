// Templates: kiln's own and the team's (built through E2B's Template API); a team template's
// builds with their state, and a build's log, polled while the build runs.
import { html } from "htm/preact";
import { useEffect, useRef, useState } from "preact/hooks";
import { get, enc } from "./api.js";
import { usePoll, time, ErrorNote } from "./util.js";

const RUNNING = new Set(["waiting", "building"]);

/** A build's log: read through the API's build status (`logsOffset` pages), every second
 * while the build runs, once more when it ends. */
function BuildLog({ tpl, build }) {
  const [lines, setLines] = useState([]);
  const [status, setStatus] = useState(build.status);
  const [reason, setReason] = useState(null);
  const [err, setErr] = useState(null);
  const state = useRef({ offset: 0, done: false });
  const box = useRef(null);
  usePoll(
    async () => {
      const s = state.current;
      if (s.done) return;
      try {
        for (;;) {
          const r = await get(`/templates/${enc(tpl)}/builds/${enc(build.buildID)}/status?logsOffset=${s.offset}&limit=100`);
          const got = r.logEntries || [];
          s.offset += got.length;
          if (got.length) setLines((old) => old.concat(got));
          setStatus(r.status);
          if (r.reason) setReason(r.reason);
          if (got.length < 100) {
            if (!RUNNING.has(r.status)) s.done = true;
            break;
          }
        }
        setErr(null);
      } catch (e) {
        setErr(e);
      }
    },
    1000,
    [tpl, build.buildID],
  );
  useEffect(() => {
    const b = box.current;
    if (b) b.scrollTop = b.scrollHeight;
  }, [lines.length]);
  const why = reason && (reason.message || JSON.stringify(reason));
  return html`<div class="panel build-log" id=${`log-${build.buildID}`}>
    <h3>Log of build <code>${build.buildID}</code>: <span class="build-status" data-status=${status}>${status}</span></h3>
    <${ErrorNote} err=${err} />
    ${why && html`<p class="error" role="alert">${why}</p>`}
    <ol class="stream log" ref=${box} aria-live="polite" aria-label=${`Log lines of build ${build.buildID}`}>
      ${lines.map((l) => html`<li data-level=${l.level}><time>${time(l.timestamp)}</time><span class=${`lvl ${l.level}`}>${l.level}</span> ${l.message}</li>`)}
    </ol>
    ${lines.length === 0 && html`<p class="empty">No log lines yet.</p>`}</div>`;
}

function Builds({ tpl }) {
  const [data, setData] = useState(null);
  const [err, setErr] = useState(null);
  const [open, setOpen] = useState(null);
  usePoll(
    async () => {
      try {
        const r = await fetch(`/console/builds/${enc(tpl)}`, { credentials: "same-origin", headers: { accept: "application/json" } });
        const v = await r.json();
        if (!r.ok) throw new Error(v.message || `${r.status}`);
        setData(v);
        setErr(null);
        setOpen((o) => o ?? v.builds[0]?.buildID ?? null);
      } catch (e) {
        setErr(e);
      }
    },
    3000,
    [tpl],
  );
  const shown = data && data.builds.find((b) => b.buildID === open);
  return html`<div class="builds"><${ErrorNote} err=${err} />
    ${data && (data.builds.length === 0 ? html`<p class="empty">No builds.</p>`
      : html`<table class="list builds-table"><caption>Builds of ${data.name} (newest first)</caption><thead><tr>
        <th scope="col">Build</th><th scope="col">Status</th><th scope="col">Tags</th><th scope="col">Started</th>
        <th scope="col">Finished</th><th scope="col">Log</th></tr></thead>
        <tbody>${data.builds.map((b) => html`<tr data-build=${b.buildID}><td><code>${b.buildID}</code></td>
          <td class="build-status">${b.status}</td><td>${b.tags.join(", ")}</td><td>${time(b.createdAt)}</td><td>${time(b.finishedAt)}</td>
          <td><button type="button" aria-pressed=${open === b.buildID} onClick=${() => setOpen(b.buildID)}
            aria-label=${`Show the log of build ${b.buildID}`}>Show log</button></td></tr>`)}</tbody></table>`)}
    ${shown && html`<${BuildLog} key=${shown.buildID} tpl=${data.templateID} build=${shown} />`}</div>`;
}

export function Templates() {
  const [rows, setRows] = useState(null);
  const [err, setErr] = useState(null);
  const [open, setOpen] = useState(null);
  usePoll(
    async () => {
      try {
        // The team's templates and kiln's own (`/templates`: the host's); without the Template
        // API, kiln's own.
        const host = await get("/templates");
        const all = await get("/v2/templates").catch((e) => (e.status === 501 ? host : Promise.reject(e)));
        const ids = new Set(host.map((t) => t.templateID));
        setRows(all.map((t) => ({ ...t, teamBuilt: !ids.has(t.templateID) })));
        setErr(null);
      } catch (e) {
        setErr(e);
      }
    },
    5000,
  );
  return html`<section aria-labelledby="h-tpl"><h1 id="h-tpl">Templates</h1><${ErrorNote} err=${err} />
    ${rows && html`<table class="list" id="templates"><thead><tr><th scope="col">Template</th><th scope="col">Build</th>
      <th scope="col">Resources</th><th scope="col">Built</th><th scope="col">Sandboxes started</th><th scope="col">Builds</th></tr></thead>
      <tbody>${rows.map((t) => {
        const built = t.teamBuilt;
        return html`<tr data-template=${t.templateID}><td>${(t.names && t.names[0]) || t.templateID}</td>
          <td><code>${String(t.buildID || "–").slice(0, 12)}</code>${built && t.buildStatus !== "ready" ? ` (${t.buildStatus})` : ""}</td>
          <td>${t.cpuCount} vCPU, ${t.memoryMB} MiB, ${t.diskSizeMB} MiB disk</td><td>${time(t.createdAt)}</td><td>${t.spawnCount}</td>
          <td>${built ? html`<button type="button" aria-expanded=${open === t.templateID}
            onClick=${() => setOpen(open === t.templateID ? null : t.templateID)}
            aria-label=${`Builds of ${(t.names && t.names[0]) || t.templateID}`}>${open === t.templateID ? "Hide builds" : "Builds"}</button>`
            : html`<span class="hint">built on the host</span>`}</td></tr>`;
      })}</tbody></table>`}
    ${open && html`<${Builds} key=${open} tpl=${open} />`}
    <p class="hint">kiln's own templates are built on the server host with <code>kiln template build</code>; a team's,
    with E2B's Template API (<code>Template.build</code> in the e2b SDK).</p></section>`;
}
