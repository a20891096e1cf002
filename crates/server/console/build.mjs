// Bundles src/main.js (preact + htm, uPlot, xterm.js, noVNC and their CSS) into dist/app.js
// and dist/app.css, which kiln embeds. The bundle is an ES module: noVNC awaits at top level.
// `node build.mjs --outdir DIR` writes elsewhere (the reproducibility check compares that with
// the committed dist/).
import { build } from "esbuild";

const i = process.argv.indexOf("--outdir");
const outdir = i > 0 ? process.argv[i + 1] : "dist";

await build({
  entryPoints: { app: "src/main.js" },
  bundle: true,
  minify: true,
  format: "esm",
  target: ["chrome110", "firefox110", "safari16"],
  outdir,
  legalComments: "eof",
  charset: "utf8",
  logLevel: "warning",
});
