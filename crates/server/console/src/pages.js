// The smaller pages: snapshots, and webhooks with their delivery log.
import { html } from "htm/preact";
import { useState } from "preact/hooks";
import { get, enc } from "./api.js";
import { usePoll, time, ErrorNote, mib } from "./util.js";

function useList(path, ms = 5000) {
  const [rows, setRows] = useState(null);
  const [err, setErr] = useState(null);
  usePoll(
    async () => {
      try {
        setRows(await get(path));
        setErr(null);
      } catch (e) {
        setErr(e);
      }
    },
    ms,
    [path],
  );
  return [rows, err];
}

export function Snapshots() {
  const [rows, err] = useList("/snapshots");
  return html`<section aria-labelledby="h-snap"><h1 id="h-snap">Snapshots</h1><${ErrorNote} err=${err} />
    ${rows && (rows.length === 0 ? html`<p class="empty">No snapshots yet.</p>`
      : html`<table class="list" id="snapshots"><thead><tr><th scope="col">Snapshot</th><th scope="col">Names</th>
      <th scope="col">From sandbox</th><th scope="col">Template</th><th scope="col">Size</th><th scope="col">Created</th></tr></thead>
      <tbody>${rows.map((s) => html`<tr><td><code>${s.snapshotID}</code></td><td>${(s.names || []).join(", ")}</td>
        <td><a href=${`#/sandboxes/${enc(s.sandboxID)}`}>${s.sandboxID}</a></td><td>${s.templateID}</td>
        <td>${mib(s.sizeBytes)}</td><td>${time(s.createdAt)}</td></tr>`)}</tbody></table>`)}</section>`;
}

function Deliveries({ id }) {
  const [r, err] = useList(`/webhooks/${enc(id)}/deliveries?limit=50`, 3000);
  return html`<${ErrorNote} err=${err} />${r && (r.deliveries.length === 0 ? html`<p class="empty">No deliveries yet.</p>`
    : html`<table class="list"><caption>Delivery log (newest first)</caption><thead><tr><th scope="col">Event</th><th scope="col">Status</th><th scope="col">Attempts</th>
      <th scope="col">HTTP</th><th scope="col">Last attempt</th><th scope="col">Error</th></tr></thead>
      <tbody>${r.deliveries.map((d) => html`<tr><td>${d.type}</td><td>${d.status}</td><td>${d.attempts}</td>
        <td>${d.lastStatusCode ?? "–"}</td><td>${time(d.lastAttemptAt)}</td><td>${d.lastError || ""}</td></tr>`)}</tbody></table>`)}`;
}

export function Webhooks() {
  const [rows, err] = useList("/webhooks");
  const [open, setOpen] = useState(null);
  return html`<section aria-labelledby="h-wh"><h1 id="h-wh">Webhooks</h1><${ErrorNote} err=${err} />
    ${rows && (rows.length === 0 ? html`<p class="empty">No webhooks. <code>POST /webhooks</code> adds one.</p>`
      : html`<ul class="cards">${rows.map((w) => html`<li><p><strong>${w.url}</strong> <code>${w.id}</code></p>
        <p>Events: ${w.events.join(", ")} · created ${time(w.createdAt)}</p>
        <button type="button" aria-expanded=${open === w.id} onClick=${() => setOpen(open === w.id ? null : w.id)}>
          ${open === w.id ? "Hide" : "Show"} deliveries</button>
        ${open === w.id && html`<${Deliveries} id=${w.id} />`}</li>`)}</ul>`)}</section>`;
}
