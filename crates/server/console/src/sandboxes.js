// The sandboxes page: the team's running and paused sandboxes with state, template, age and
// CPU/memory sparklines from the metrics history, filtered by state and template.
import { html } from "htm/preact";
import { useEffect, useState } from "preact/hooks";
import { get, enc } from "./api.js";
import { Sparkline, series } from "./chart.js";
import { usePoll, age, ErrorNote } from "./util.js";

const WINDOW_S = 600;

export function SandboxList() {
  const [state, setState] = useState("");
  const [template, setTemplate] = useState("");
  const [rows, setRows] = useState(null);
  const [hist, setHist] = useState({});
  const [err, setErr] = useState(null);
  usePoll(async () => {
    try {
      const list = await get(`/v2/sandboxes?state=running,paused&limit=1000`);
      setRows(list);
      setErr(null);
      const since = Math.floor(Date.now() / 1000) - WINDOW_S;
      const h = {};
      await Promise.all(
        list.map(async (s) => {
          try {
            h[s.sandboxID] = series(await get(`/sandboxes/${enc(s.sandboxID)}/metrics?start=${since}`));
          } catch {}
        }),
      );
      setHist(h);
    } catch (e) {
      setErr(e);
    }
  }, 3000);
  const templates = [...new Set((rows || []).map((r) => r.templateID))].sort();
  const shown = (rows || []).filter((r) => (!state || r.state === state) && (!template || r.templateID === template));
  return html`<section aria-labelledby="h-sbx">
    <h1 id="h-sbx">Sandboxes</h1>
    <form class="filters" onSubmit=${(e) => e.preventDefault()}>
      <label for="f-state">State</label>
      <select id="f-state" value=${state} onChange=${(e) => setState(e.target.value)}>
        <option value="">all</option><option value="running">running</option><option value="paused">paused</option>
      </select>
      <label for="f-template">Template</label>
      <select id="f-template" value=${template} onChange=${(e) => setTemplate(e.target.value)}>
        <option value="">all</option>
        ${templates.map((t) => html`<option value=${t}>${t}</option>`)}
      </select>
    </form>
    <${ErrorNote} err=${err} />
    ${rows === null
      ? html`<p>Loading…</p>`
      : shown.length === 0
        ? html`<p class="empty">No sandboxes${state || template ? " match these filters" : " yet"}.</p>`
        : html`<table class="list" id="sandboxes">
            <thead><tr><th scope="col">Sandbox</th><th scope="col">State</th><th scope="col">Template</th>
              <th scope="col">Age</th><th scope="col">CPU</th><th scope="col">Memory</th></tr></thead>
            <tbody>
              ${shown.map((s) => {
                const h = hist[s.sandboxID] || { xs: [], cpu: [], memMiB: [] };
                return html`<tr data-sandbox=${s.sandboxID}>
                  <td><a href=${`#/sandboxes/${enc(s.sandboxID)}`}>${s.sandboxID}</a></td>
                  <td><span class=${`state ${s.state}`}>${s.state}</span></td>
                  <td>${s.templateID}</td>
                  <td>${age(s.startedAt)}</td>
                  <td><${Sparkline} label=${`CPU of ${s.sandboxID}`} unit="%" xs=${h.xs} ys=${h.cpu} max=${100} /></td>
                  <td><${Sparkline} label=${`Memory of ${s.sandboxID}`} unit=" MiB" xs=${h.xs} ys=${h.memMiB} /></td>
                </tr>`;
              })}
            </tbody>
          </table>`}
  </section>`;
}
