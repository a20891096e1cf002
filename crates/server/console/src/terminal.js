// A terminal (xterm.js) on a login shell in the sandbox, over the console's WebSocket
// (/console/terminal/{id}): keystrokes go as binary frames, resizes as {"resize":[c,r]}.
import { html } from "htm/preact";
import { useEffect, useRef, useState } from "preact/hooks";
import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { session, enc } from "./api.js";

export function TerminalView({ id, onClose }) {
  const ref = useRef(null);
  const [status, setStatus] = useState("connecting…");
  useEffect(() => {
    const term = new Terminal({ cursorBlink: true, fontSize: 13, convertEol: false, scrollback: 2000 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(ref.current);
    try {
      fit.fit();
    } catch {}
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${proto}//${location.host}/console/terminal/${enc(id)}?csrf=${enc(session.csrf)}` +
      `&cols=${term.cols}&rows=${term.rows}`;
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    const te = new TextEncoder();
    ws.onopen = () => {
      setStatus("connected");
      term.focus();
    };
    ws.onmessage = (m) => {
      if (typeof m.data === "string") {
        const v = JSON.parse(m.data);
        if ("exit" in v) setStatus(`shell exited with code ${v.exit}`);
        if (v.error) setStatus(v.error);
      } else term.write(new Uint8Array(m.data));
    };
    ws.onclose = () => setStatus((s) => (s === "connected" || s === "connecting…" ? "disconnected" : s));
    const d1 = term.onData((d) => ws.readyState === 1 && ws.send(te.encode(d)));
    const d2 = term.onResize(({ cols, rows }) => ws.readyState === 1 && ws.send(JSON.stringify({ resize: [cols, rows] })));
    const onWin = () => {
      try {
        fit.fit();
      } catch {}
    };
    window.addEventListener("resize", onWin);
    return () => {
      window.removeEventListener("resize", onWin);
      d1.dispose();
      d2.dispose();
      ws.close();
      term.dispose();
    };
  }, [id]);
  return html`<section class="terminal" aria-label="Terminal">
    <div class="term-bar"><span role="status" id="term-status">Terminal: ${status}</span>
      <button type="button" onClick=${onClose}>Close terminal</button></div>
    <div class="term" ref=${ref} id="term"></div>
  </section>`;
}
