// The console's entry: the navigation, the sign-out form and a hash router over the pages.
import "uplot/dist/uPlot.min.css";
import "@xterm/xterm/css/xterm.css";
import "./style.css";
import { html } from "htm/preact";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { session } from "./api.js";
import { SandboxList } from "./sandboxes.js";
import { SandboxPage } from "./sandbox.js";
import { Snapshots, Webhooks } from "./pages.js";
import { Templates } from "./templates.js";
import { KeysPage } from "./keys.js";

const NAV = [
  ["#/sandboxes", "Sandboxes"],
  ["#/templates", "Templates"],
  ["#/snapshots", "Snapshots"],
  ["#/webhooks", "Webhooks"],
  ["#/keys", "Keys and teams"],
];

function useHash() {
  const [h, setH] = useState(location.hash || "#/sandboxes");
  useEffect(() => {
    const on = () => setH(location.hash || "#/sandboxes");
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return h;
}

function page(h) {
  const m = h.match(/^#\/sandboxes\/(.+)$/);
  if (m) return html`<${SandboxPage} id=${decodeURIComponent(m[1])} />`;
  switch (h) {
    case "#/templates":
      return html`<${Templates} />`;
    case "#/snapshots":
      return html`<${Snapshots} />`;
    case "#/webhooks":
      return html`<${Webhooks} />`;
    case "#/keys":
      return html`<${KeysPage} />`;
    default:
      return html`<${SandboxList} />`;
  }
}

function App() {
  const h = useHash();
  useEffect(() => {
    const main = document.getElementById("main");
    if (main) main.focus({ preventScroll: true });
  }, [h.replace(/\/[^/]*$/, "")]);
  return html`<a class="skip" href="#main" onClick=${(e) => { e.preventDefault(); document.getElementById("main").focus(); }}>Skip to content</a>
    <header class="top">
      <span class="brand">kiln</span>
      <nav aria-label="Main"><ul>
        ${NAV.map(([href, label]) => html`<li><a href=${href} aria-current=${h.startsWith(href) ? "page" : undefined}>${label}</a></li>`)}
      </ul></nav>
      <form method="post" action="/console/logout" class="signout">
        <input type="hidden" name="csrf" value=${session.csrf} />
        <span class="who">team <strong>${session.team}</strong></span>
        <button type="submit">Sign out</button>
      </form>
    </header>
    <main id="main" tabindex="-1">${page(h)}</main>`;
}

const root = document.getElementById("app");
root.textContent = "";
render(html`<${App} />`, root);
