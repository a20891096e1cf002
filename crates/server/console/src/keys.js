// Keys and teams: the team's API keys (prefixes only; create shows a secret once, revoke asks
// once more) and its quotas with what it uses of them, through /api-keys and /teams. The
// operator's team (default) sees every team and may make a key for any of them.
import { html } from "htm/preact";
import { useState } from "preact/hooks";
import { api, get, enc, session } from "./api.js";
import { usePoll, time, ErrorNote } from "./util.js";

const OPERATOR = "default";
const limit = (v) => (v == null ? "no limit" : String(v));

function Teams({ teams }) {
  return html`<table class="list" id="teams"><caption>Quotas and use</caption><thead><tr><th scope="col">Team</th>
    <th scope="col">Sandboxes (running, paused)</th><th scope="col">Max sandboxes</th><th scope="col">Max timeout</th>
    <th scope="col">Creates per minute</th><th scope="col">Active keys</th></tr></thead>
    <tbody>${teams.map((t) => html`<tr data-team=${t.name}><td>${t.name}${t.isDefault ? " (yours)" : ""}</td>
      <td class="usage">${t.usage.sandboxes} (${t.usage.running}, ${t.usage.paused})</td>
      <td class="q-max">${limit(t.quota.maxSandboxes)}</td>
      <td>${t.quota.maxTimeoutSecs == null ? "no limit" : `${t.quota.maxTimeoutSecs} s`}</td>
      <td>${limit(t.quota.createsPerMinute)}</td><td>${t.activeKeys}</td></tr>`)}</tbody></table>`;
}

function CreateKey({ onMade }) {
  const [name, setName] = useState("");
  const [team, setTeam] = useState(session.team);
  const [busy, setBusy] = useState(false);
  const [err, setErr] = useState(null);
  const [made, setMade] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setErr(null);
    try {
      const body = { name: name.trim() };
      if (team !== session.team) body.team = team.trim();
      const k = await api("POST", "/api-keys", body);
      setMade(k);
      setName("");
      onMade();
    } catch (x) {
      setErr(x);
    } finally {
      setBusy(false);
    }
  };
  return html`<form class="create-key" onSubmit=${submit} aria-labelledby="h-new-key">
    <h2 id="h-new-key">New key</h2>
    <div class="filters">
      <label for="key-name">Key name</label>
      <input id="key-name" required maxlength="64" value=${name} onInput=${(e) => setName(e.target.value)} />
      ${session.team === OPERATOR && html`<label for="key-team">Team</label>
        <input id="key-team" required maxlength="64" value=${team}
          onInput=${(e) => setTeam(e.target.value)} />`}
      <button type="submit" disabled=${busy}>Create key</button>
    </div>
    <${ErrorNote} err=${err} />
    ${made && html`<div class="secret" role="status">
      <label for="new-secret">Key <code>${made.id}</code> for team ${made.team}: copy it now, it is not shown again</label>
      <input id="new-secret" readonly value=${made.key} size="48" onFocus=${(e) => e.target.select()} />
      <button type="button" onClick=${() => setMade(null)}>Done</button></div>`}
  </form>`;
}

function KeyRow({ k, onChange }) {
  const [asking, setAsking] = useState(false);
  const [err, setErr] = useState(null);
  const mine = k.id === session.key;
  const revoke = async () => {
    try {
      await api("DELETE", `/api-keys/${enc(k.id)}`);
      setAsking(false);
      if (mine) location.href = "/console";
      else onChange();
    } catch (x) {
      setErr(x);
      setAsking(false);
    }
  };
  return html`<tr data-key=${k.id}><td><code>${k.id}</code>${mine ? " (this session)" : ""}</td><td>${k.name}</td>
    <td>${k.team}</td><td><code>${k.prefix}…</code></td><td>${time(k.createdAt)}</td><td>${time(k.lastUsed)}</td>
    <td class="status">${k.revokedAt ? `revoked ${time(k.revokedAt)}` : "active"}</td>
    <td>${!k.revokedAt && (asking
      ? html`<button type="button" class="danger" onClick=${revoke}>Confirm revoke ${k.name}</button>
        <button type="button" onClick=${() => setAsking(false)}>Cancel</button>`
      : html`<button type="button" onClick=${() => setAsking(true)} aria-label=${`Revoke ${k.name} (${k.id})`}>Revoke</button>`)}
      ${err && html`<span class="error" role="alert">${err.message}</span>`}</td></tr>`;
}

export function KeysPage() {
  const [keys, setKeys] = useState(null);
  const [teams, setTeams] = useState(null);
  const [err, setErr] = useState(null);
  const [tick, setTick] = useState(0);
  usePoll(
    async () => {
      try {
        const [k, t] = await Promise.all([get("/api-keys"), get("/teams")]);
        setKeys(k);
        setTeams(t);
        setErr(null);
      } catch (x) {
        setErr(x);
      }
    },
    5000,
    [tick],
  );
  const refresh = () => setTick(tick + 1);
  return html`<section aria-labelledby="h-acct"><h1 id="h-acct">Keys and teams</h1><${ErrorNote} err=${err} />
    <dl class="facts"><dt>Team</dt><dd id="acct-team">${session.team}</dd><dt>Signed in with key</dt><dd><code>${session.key}</code></dd></dl>
    ${teams && html`<${Teams} teams=${teams} />`}
    <${CreateKey} onMade=${refresh} />
    ${keys && html`<table class="list" id="keys"><caption>${session.team === OPERATOR ? "Every team's API keys" : "The team's API keys"}</caption>
      <thead><tr><th scope="col">Key</th><th scope="col">Name</th><th scope="col">Team</th><th scope="col">Prefix</th>
      <th scope="col">Created</th><th scope="col">Last used</th><th scope="col">Status</th><th scope="col">Action</th></tr></thead>
      <tbody>${keys.map((k) => html`<${KeyRow} key=${k.id} k=${k} onChange=${refresh} />`)}</tbody></table>`}
    <p class="hint">Revoking the key this session signed in with signs it out. Quotas are set on the server host
    with <code>kiln team set</code>.</p></section>`;
}
