// Shared pieces of the test files: a fresh base sandbox per test (killed afterwards), and
// polling instead of sleeps.

import { Sandbox } from 'e2b'

if (!process.env.E2B_API_URL) {
  throw new Error('E2B_API_URL is not set: run the suite through tests/js/run.mjs (it starts kiln serve)')
}

/** A base sandbox for `fn`, killed when it returns or throws. */
export async function withSandbox(fn, opts = {}) {
  const sbx = await Sandbox.create({ timeoutMs: 120_000, ...opts })
  try {
    return await fn(sbx)
  } finally {
    await sbx.kill().catch(() => {})
  }
}

/** Polls `cond` every 50 ms until it is truthy (returned) or `timeoutMs` passes (throws `what`). */
export async function waitFor(cond, what, timeoutMs = 15_000) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const v = await cond()
    if (v) return v
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 50))
  }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
