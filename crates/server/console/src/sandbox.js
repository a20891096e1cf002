// One sandbox: its state and actions (pause, resume, fork, kill), live CPU/memory/disk plots
// from the metrics history, lifecycle events (kill events among them), alerts, the audit
// stream with kind filters, a terminal, and for desktop sandboxes the live desktop (noVNC).
import { html } from "htm/preact";
import { useState } from "preact/hooks";
import { api, get, enc } from "./api.js";
import { Plot, series } from "./chart.js";
import { usePoll, age, time, ErrorNote } from "./util.js";
import { TerminalView } from "./terminal.js";
import { DesktopPanel } from "./desktop.js";

const KINDS = ["process", "file", "net", "dns", "lifecycle", "api", "syscall"];
const KEEP = 300;

function Actions({ sbx, gone, id, onDone }) {
  const [busy, setBusy] = useState(null);
  const [msg, setMsg] = useState(null);
  const [confirmKill, setConfirmKill] = useState(false);
  const act = async (name, method, path, body) => {
    setBusy(name);
    setMsg(null);
    try {
      const r = await api(method, path, body);
      if (name === "fork") {
        const items = Array.isArray(r) ? r : [];
        const ids = items.map((x) => x.sandbox && x.sandbox.sandboxID).filter(Boolean);
        const errs = items.map((x) => x.error && x.error.message).filter(Boolean);
        if (!ids.length) throw new Error(errs.join("; ") || "no sandbox was made");
        setMsg({ ok: true, text: "Forked: ", links: ids });
      } else setMsg({ ok: true, text: `${name} done.` });
      onDone();
    } catch (e) {
      setMsg({ ok: false, text: `${name} failed: ${e.message}` });
    } finally {
      setBusy(null);
      setConfirmKill(false);
    }
  };
  const running = sbx && !gone && sbx.state === "running";
  const paused = sbx && !gone && sbx.state === "paused";
  const base = `/sandboxes/${enc(id)}`;
  return html`<div class="actions" role="group" aria-label="Sandbox actions">
    <button type="button" disabled=${!running || busy} onClick=${() => act("pause", "POST", `${base}/pause`)}>Pause</button>
    <button type="button" disabled=${!paused || busy} onClick=${() => act("resume", "POST", `${base}/connect`, { timeout: 300 })}>Resume</button>
    <button type="button" disabled=${!running || busy} onClick=${() => act("fork", "POST", `${base}/fork`, {})}>Fork</button>
    ${confirmKill
      ? html`<button type="button" class="danger" disabled=${busy} onClick=${() => act("kill", "DELETE", base)}>Confirm kill</button>
          <button type="button" onClick=${() => setConfirmKill(false)}>Cancel</button>`
      : html`<button type="button" class="danger" disabled=${!sbx || gone || busy} onClick=${() => setConfirmKill(true)}>Kill</button>`}
    ${msg && html`<span class=${msg.ok ? "ok" : "error"} role="status">${msg.text}
      ${(msg.links || []).map((l) => html`<a class="fork" href=${`#/sandboxes/${enc(l)}`}>${l}</a> `)}</span>`}
  </div>`;
}

function Audit({ id }) {
  const [kinds, setKinds] = useState(KINDS.filter((k) => k !== "syscall"));
  const [recs, setRecs] = useState([]);
  const [cursor, setCursor] = useState(null);
  const key = kinds.join(",");
  usePoll(
    async () => {
      if (!kinds.length) return setRecs([]);
      const c = cursor && cursor.key === key ? cursor.at : "";
      const r = await get(`/sandboxes/${enc(id)}/audit?kind=${enc(key)}&limit=500${c ? `&cursor=${c}` : ""}`);
      const fresh = !cursor || cursor.key !== key;
      setRecs((old) => (fresh ? r.records : [...old, ...r.records]).slice(-KEEP));
      setCursor({ key, at: r.nextCursor });
    },
    2000,
    [id, key],
  );
  const toggle = (k) => setKinds((ks) => (ks.includes(k) ? ks.filter((x) => x !== k) : KINDS.filter((x) => x === k || ks.includes(x))));
  return html`<section aria-labelledby="h-audit" class="panel">
    <h2 id="h-audit">Audit</h2>
    <fieldset class="kinds"><legend>Kinds</legend>
      ${KINDS.map((k) => html`<label><input type="checkbox" checked=${kinds.includes(k)} onChange=${() => toggle(k)} /> ${k}</label>`)}
    </fieldset>
    <ol class="stream" id="audit" aria-live="polite">
      ${[...recs].reverse().map((r) => html`<li data-kind=${r.kind}><time>${time(r.timestamp)}</time>
        <span class=${`kind ${r.kind}`}>${r.kind}</span> <code>${summary(r.body)}</code></li>`)}
    </ol>
  </section>`;
}

function summary(b) {
  if (!b || typeof b !== "object") return String(b);
  const parts = [];
  for (const k of ["op", "event", "method", "route", "status", "cmd", "path", "host", "addr", "verdict", "name", "reason"]) {
    if (b[k] !== undefined && b[k] !== null) parts.push(`${k}=${typeof b[k] === "object" ? JSON.stringify(b[k]) : b[k]}`);
  }
  return parts.length ? parts.join(" ") : JSON.stringify(b).slice(0, 200);
}

function Events({ id }) {
  const [events, setEvents] = useState([]);
  const [alerts, setAlerts] = useState([]);
  const [err, setErr] = useState(null);
  usePoll(
    async () => {
      try {
        const e = await get(`/sandboxes/${enc(id)}/events?limit=1000`);
        setEvents(e.events || []);
        try {
          const a = await get(`/alerts?sandboxID=${enc(id)}&limit=200`);
          setAlerts(a.alerts || []);
        } catch (x) {
          if (x.status !== 501) throw x;
        }
        setErr(null);
      } catch (x) {
        setErr(x);
      }
    },
    2000,
    [id],
  );
  return html`<section aria-labelledby="h-events" class="panel">
    <h2 id="h-events">Events and alerts</h2>
    <${ErrorNote} err=${err} />
    <ol class="stream" id="events" aria-live="polite">
      ${alerts.map((a) => html`<li class="alert" data-type="alert"><time>${time(a.timestamp)}</time>
        <span class=${`prio ${a.priority}`}>${a.priority}</span> <strong>${a.rule}</strong> ${a.output}</li>`)}
      ${[...events].reverse().map((e) => html`<li data-type=${e.type}><time>${time(e.timestamp)}</time>
        <span class=${`ev ${e.type}`}>${e.type}</span> <code>${e.detail == null ? "" : typeof e.detail === "string" ? e.detail : JSON.stringify(e.detail)}</code></li>`)}
    </ol>
  </section>`;
}

export function SandboxPage({ id }) {
  const [sbx, setSbx] = useState(null);
  const [gone, setGone] = useState(false);
  const [m, setM] = useState(series([]));
  const [err, setErr] = useState(null);
  const [term, setTerm] = useState(false);
  const load = async () => {
    try {
      setSbx(await get(`/sandboxes/${enc(id)}`));
      setGone(false);
    } catch (e) {
      if (e.status === 404) {
        setGone(true);
      } else setErr(e);
    }
    try {
      const since = Math.floor(Date.now() / 1000) - 900;
      setM(series(await get(`/sandboxes/${enc(id)}/metrics?start=${since}`)));
      setErr(null);
    } catch (e) {
      if (e.status !== 404) setErr(e);
    }
  };
  usePoll(load, 2000, [id]);
  const running = sbx && !gone && sbx.state === "running";
  return html`<section aria-labelledby="h-one">
    <p><a href="#/sandboxes">← Sandboxes</a></p>
    <h1 id="h-one">Sandbox <code>${id}</code></h1>
    <dl class="facts">
      <dt>State</dt><dd id="sbx-state">${gone ? html`<span class="state ended">ended</span>` : sbx ? html`<span class=${`state ${sbx.state}`}>${sbx.state}</span>` : "…"}</dd>
      <dt>Template</dt><dd>${sbx ? sbx.templateID : "–"}</dd>
      <dt>Started</dt><dd>${sbx ? `${time(sbx.startedAt)} (${age(sbx.startedAt)} ago)` : "–"}</dd>
      <dt>${gone ? "Timeout at" : "Ends"}</dt><dd>${sbx ? time(sbx.endAt) : "–"}</dd>
      <dt>CPU / memory</dt><dd>${sbx ? `${sbx.cpuCount} vCPU, ${sbx.memoryMB} MiB` : "–"}</dd>
    </dl>
    <${Actions} sbx=${sbx} gone=${gone} id=${id} onDone=${load} />
    <${ErrorNote} err=${err} />
    <div class="plots">
      <${Plot} id="plot-cpu" label="CPU" unit="%" xs=${m.xs} ys=${m.cpu} max=${100} />
      <${Plot} id="plot-mem" label="Memory" unit=" MiB" xs=${m.xs} ys=${m.memMiB} color="#1f9d55" />
      <${Plot} id="plot-disk" label="Disk" unit=" MiB" xs=${m.xs} ys=${m.diskMiB} color="#b7791f" />
    </div>
    ${running &&
    (term
      ? html`<${TerminalView} id=${id} onClose=${() => setTerm(false)} />`
      : html`<p><button type="button" id="open-terminal" onClick=${() => setTerm(true)}>Open terminal</button></p>`)}
    ${running && html`<${DesktopPanel} id=${id} />`}
    <div class="columns">
      <${Events} id=${id} />
      <${Audit} id=${id} />
    </div>
  </section>`;
}
