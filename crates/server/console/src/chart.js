// uPlot charts as preact components: a sparkline for lists and a time plot for one series.
// Each chart's container carries an aria-label with its newest value and sample count (and
// data-* attributes with the same), so a screen reader and the tests can read what is drawn.
import { html } from "htm/preact";
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";

function describe(label, unit, xs, ys) {
  const n = ys.length;
  if (!n) return `${label}: no samples yet`;
  const last = ys[n - 1];
  const at = new Date(xs[n - 1] * 1000).toLocaleTimeString();
  return `${label}: ${fmt(last)}${unit} at ${at}, ${n} samples`;
}

const tick = (v) => (v >= 10 || v === 0 ? v.toFixed(0) : v.toPrecision(2));

export const fmt = (v) => (v == null ? "–" : Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1));

function useUplot(ref, opts, xs, ys) {
  const plot = useRef(null);
  useEffect(() => {
    plot.current = new uPlot(opts(), [xs, ys], ref.current);
    return () => plot.current && plot.current.destroy();
  }, []);
  useEffect(() => {
    if (plot.current) plot.current.setData([xs, ys]);
  }, [xs, ys]);
}

/** A small line with no axes: `xs` Unix seconds, `ys` values. */
export function Sparkline({ label, unit = "", xs, ys, max }) {
  const ref = useRef(null);
  useUplot(
    ref,
    () => ({
      width: 120,
      height: 28,
      cursor: { show: false },
      legend: { show: false },
      select: { show: false },
      axes: [{ show: false }, { show: false }],
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, max ?? (hi > 0 ? hi * 1.2 : 1)] } },
      series: [{}, { stroke: "#2f6fde", fill: "rgba(47,111,222,.15)", width: 1.5 }],
    }),
    xs,
    ys,
  );
  const d = describe(label, unit, xs, ys);
  return html`<div class="spark" ref=${ref} role="img" aria-label=${d} title=${d}
    data-points=${ys.length} data-last=${ys.length ? ys[ys.length - 1] : ""}></div>`;
}

/** A time plot of one series with axes. */
export function Plot({ id, label, unit = "", xs, ys, max, color = "#2f6fde" }) {
  const ref = useRef(null);
  useUplot(
    ref,
    () => ({
      width: 420,
      height: 160,
      legend: { show: false },
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, max ?? (hi > 0 ? hi * 1.2 : 1)] } },
      axes: [
        { stroke: "#555", font: "11px system-ui" },
        { stroke: "#555", size: 72, font: "11px system-ui", values: (u, v) => v.map((x) => tick(x) + unit) },
      ],
      series: [{}, { label, stroke: color, fill: color + "22", width: 2 }],
    }),
    xs,
    ys,
  );
  const d = describe(label, unit, xs, ys);
  return html`<figure class="plot">
    <figcaption>${label} <span class="now">${ys.length ? fmt(ys[ys.length - 1]) + unit : "–"}</span></figcaption>
    <div id=${id} ref=${ref} role="img" aria-label=${d}
      data-points=${ys.length} data-last=${ys.length ? ys[ys.length - 1] : ""}></div>
  </figure>`;
}

/** Metric samples (`GET /sandboxes/{id}/metrics`) as plot series. */
export function series(samples) {
  const xs = samples.map((s) => s.timestampUnix);
  const pct = (a, b) => (b ? (100 * a) / b : 0);
  return {
    xs,
    cpu: samples.map((s) => s.cpuUsedPct),
    memMiB: samples.map((s) => s.memUsed / 1048576),
    memPct: samples.map((s) => pct(s.memUsed, s.memTotal)),
    diskMiB: samples.map((s) => s.diskUsed / 1048576),
  };
}
