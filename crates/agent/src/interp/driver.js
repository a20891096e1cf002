// The JavaScript context's driver, run by `node` for the kiln code interpreter. Cells arrive as
// JSON lines on stdin ({"code", "env"}); every cell runs in one persistent V8 context (so
// declarations persist across cells, as in a REPL) and answers with JSON lines on stdout:
// {"stdout"}, {"stderr"}, {"result"}, {"error": {name, value, traceback}}, then {"done"}.
"use strict";
const vm = require("vm");
const util = require("util");
const readline = require("readline");

const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");
const fmt = (args) => util.formatWithOptions({ colors: false }, ...args) + "\n";
const toStdout = (...a) => { out({ stdout: fmt(a) }); };
const toStderr = (...a) => { out({ stderr: fmt(a) }); };
const cellConsole = { log: toStdout, info: toStdout, debug: toStdout, error: toStderr, warn: toStderr };
const sandbox = { console: cellConsole, require, process, Buffer, setTimeout, clearTimeout,
  setInterval, clearInterval, setImmediate, URL, TextEncoder, TextDecoder };
sandbox.globalThis = sandbox;
const context = vm.createContext(sandbox);

// SIGINT interrupts the running cell (breakOnSigint) instead of ending the process.
process.on("SIGINT", () => {});

async function run(cell) {
  const saved = {};
  for (const [k, v] of Object.entries(cell.env || {})) {
    saved[k] = process.env[k];
    process.env[k] = String(v);
  }
  try {
    const opts = { filename: "cell.js", breakOnSigint: true };
    let value;
    try {
      value = vm.runInContext(cell.code, context, opts);
    } catch (e) {
      // Top-level await: run the cell as an async function (its `let`/`const` stay local).
      if (!(e && e.name === "SyntaxError" && /await/.test(e.message))) throw e;
      value = vm.runInContext(`(async () => {\n${cell.code}\n})()`, context, opts);
    }
    if (value && typeof value.then === "function") {
      value = await value;
    }
    if (value !== undefined) {
      out({ result: util.inspect(value, { colors: false }) });
    }
  } catch (e) {
    // Errors come from the cell's own realm, so `instanceof Error` does not apply.
    const isErr = e !== null && typeof e === "object" && "message" in e;
    out({ error: {
      name: (isErr && e.name) || "Error",
      value: isErr ? String(e.message) : String(e),
      traceback: (isErr && e.stack) || String(e),
    } });
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
    out({ done: true });
  }
}

const rl = readline.createInterface({ input: process.stdin });
let queue = Promise.resolve();
rl.on("line", (line) => {
  const cell = JSON.parse(line);
  queue = queue.then(() => run(cell));
});
