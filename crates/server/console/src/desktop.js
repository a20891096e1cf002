// A desktop sandbox's screen, live, through noVNC's RFB client over the console's WebSocket
// (/console/vnc/{id}), which the server bridges to the sandbox's x11vnc (port 5900). View-only
// until the person takes control; the stream is started only when they ask for it.
import { html } from "htm/preact";
import { useEffect, useRef, useState } from "preact/hooks";
import RFB from "@novnc/novnc";
import { session, own, enc } from "./api.js";

// The remote screen, connected while mounted.
function Screen({ id, control, onState, onCredentials, rfbRef }) {
  const ref = useRef(null);
  useEffect(() => {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${proto}//${location.host}/console/vnc/${enc(id)}?csrf=${enc(session.csrf)}`;
    const rfb = new RFB(ref.current, url, { shared: true, wsProtocols: ["binary"] });
    rfb.viewOnly = true;
    rfb.scaleViewport = true;
    rfb.focusOnClick = false;
    rfb.background = "#20242b";
    rfb.addEventListener("connect", () => onState({ s: "connected" }));
    rfb.addEventListener("desktopname", (e) => onState({ s: "connected", name: e.detail.name }));
    rfb.addEventListener("disconnect", (e) =>
      onState({ s: e.detail.clean ? "disconnected" : "the connection to the desktop failed" }));
    rfb.addEventListener("credentialsrequired", () => onCredentials(true));
    rfb.addEventListener("securityfailure", (e) => onState({ s: `refused: ${e.detail.reason || "wrong password"}` }));
    rfbRef.current = rfb;
    return () => {
      rfbRef.current = null;
      rfb.disconnect();
    };
  }, [id]);
  useEffect(() => {
    const rfb = rfbRef.current;
    if (!rfb) return;
    rfb.viewOnly = !control;
    rfb.focusOnClick = control;
    if (control) rfb.focus();
    else rfb.blur();
  }, [control]);
  // Shift+Escape hands the keyboard back to the page while in control.
  const onKey = (e) => {
    if (e.key === "Escape" && e.shiftKey) {
      e.preventDefault();
      e.stopPropagation();
      rfbRef.current && rfbRef.current.blur();
      document.getElementById("desktop-control")?.focus();
    }
  };
  return html`<div class="screen" id="desktop-screen" ref=${ref} onKeyDownCapture=${onKey}></div>`;
}

export function DesktopPanel({ id }) {
  // checking | none (not a desktop) | stopped | starting | on | error
  const [phase, setPhase] = useState("checking");
  const [err, setErr] = useState(null);
  const [conn, setConn] = useState({ s: "connecting…" });
  const [control, setControl] = useState(false);
  const [needPw, setNeedPw] = useState(false);
  const [pw, setPw] = useState("");
  const [reason, setReason] = useState(null);
  const rfbRef = useRef(null);
  const check = async () => {
    try {
      const st = await own("GET", `/desktop/${enc(id)}`);
      setReason(st.reason || null);
      setPhase(!st.desktop ? "none" : st.vnc ? "on" : "stopped");
    } catch (e) {
      setErr(e.message);
      setPhase("error");
    }
  };
  useEffect(() => {
    check();
  }, [id]);
  const start = async () => {
    setPhase("starting");
    setErr(null);
    try {
      await own("POST", `/desktop/${enc(id)}/stream`);
      setPhase("on");
    } catch (e) {
      setErr(e.message);
      setPhase("stopped");
    }
  };
  if (phase === "checking" || phase === "none") return null;
  const mode = control ? "you control the keyboard and mouse" : "view only";
  return html`<section class="panel desktop" aria-labelledby="h-desktop">
    <h2 id="h-desktop">Desktop</h2>
    ${phase === "error" && html`<p class="error" role="alert">The desktop view is unavailable: ${err}</p>`}
    ${(phase === "stopped" || phase === "starting") &&
    html`<p>No VNC server is reachable in this sandbox${reason ? html` (<span class="reason">${reason}</span>)` : ""}.
        <button type="button" id="desktop-start" disabled=${phase === "starting"} onClick=${start}>
          ${phase === "starting" ? "Starting the stream…" : "Start the stream"}</button></p>
      <p class="hint">This runs x11vnc as e2b-desktop's <code>stream.start()</code> does (no password,
        port 5900); the SDK's own <code>stream.start()</code> will then report the stream as already running.</p>
      ${err && html`<p class="error" role="alert">${err}</p>`}`}
    ${phase === "on" &&
    html`<div class="desk-bar">
        <label><input type="checkbox" id="desktop-control" checked=${control}
          onChange=${(e) => setControl(e.currentTarget.checked)} /> Take control (keyboard and mouse)</label>
        <span role="status" id="desktop-status">Desktop: ${conn.s}${conn.name ? ` — ${conn.name}` : ""}; ${mode}</span>
      </div>
      ${needPw &&
      html`<form class="desk-pw" onSubmit=${(e) => {
        e.preventDefault();
        rfbRef.current && rfbRef.current.sendCredentials({ password: pw });
        setNeedPw(false);
      }}>
        <label for="desktop-pw">Stream password (the SDK's <code>stream.get_auth_key()</code>)</label>
        <input id="desktop-pw" type="password" value=${pw} onInput=${(e) => setPw(e.currentTarget.value)} />
        <button type="submit">Connect</button></form>`}
      <figure class="desk-fig">
        <${Screen} id=${id} control=${control} onState=${setConn} onCredentials=${setNeedPw} rfbRef=${rfbRef} />
        <figcaption id="desktop-caption">Live screen of this sandbox's desktop (${mode}); what runs in it
          is listed in the audit stream below.</figcaption>
      </figure>
      <p class="hint">${control
        ? "Keys go to the desktop while it has focus; Shift+Escape gives the keyboard back to the page."
        : "Tick “Take control” to type and click in the desktop."}</p>`}
  </section>`;
}
