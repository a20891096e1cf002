// Small helpers shared by the pages: polling, times, error notes.
import { html } from "htm/preact";
import { useEffect, useRef } from "preact/hooks";

/** Calls `fn` now and every `ms` while the component is shown (never two at once). */
export function usePoll(fn, ms, deps = []) {
  const f = useRef(fn);
  f.current = fn;
  useEffect(() => {
    let stop = false;
    let timer;
    const tick = async () => {
      try {
        await f.current();
      } finally {
        if (!stop) timer = setTimeout(tick, ms);
      }
    };
    tick();
    return () => {
      stop = true;
      clearTimeout(timer);
    };
  }, deps);
}

export function age(iso) {
  if (!iso) return "–";
  const s = Math.max(0, Math.floor((Date.now() - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export const time = (iso) => (iso ? new Date(iso).toLocaleString() : "–");

export function ErrorNote({ err }) {
  if (!err) return null;
  return html`<p class="error" role="alert">${err.message || String(err)}</p>`;
}

export const mib = (b) => (b == null ? "–" : `${(b / 1048576).toFixed(0)} MiB`);
