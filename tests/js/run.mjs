// Runs the JavaScript SDK suite: builds the test "internet", starts one `kiln serve` for every
// test file, runs `node --test` over the *.test.mjs files with the SDK's E2B_* settings, then
// removes the server, its sandboxes and the test network. Exit code: node's test runner's, or
// 1 when the server panicked. `node run.mjs files.test.mjs` runs one file.

import { spawn } from 'node:child_process'
import { readdirSync } from 'node:fs'
import { dirname } from 'node:path'
import { fileURLToPath } from 'node:url'

import { KilnServer } from './lib/kiln.mjs'
import { TestNet } from './lib/testnet.mjs'

const here = dirname(fileURLToPath(import.meta.url))
const files = process.argv.slice(2).length
  ? process.argv.slice(2)
  : readdirSync(here).filter((f) => f.endsWith('.test.mjs')).sort()

const net = new TestNet()
// Networking with its own host range (no other suite uses 10.181.0.0/24) and a small pool.
// KILN_SERVE_EXTRA_ARGS: more `kiln serve` flags, as for the Python suite.
const extra = (process.env.KILN_SERVE_EXTRA_ARGS || '').split(/\s+/).filter(Boolean)
const server = new KilnServer(['--net-range', '10.181.0.0/24', '--net-pool', '2', ...extra])
let rc = 1
let stopping = false
async function teardown() {
  if (stopping) return
  stopping = true
  const log = await server.teardown()
  net.down()
  if (rc !== 0 || log.includes('panicked')) console.log(`---- kiln serve log (tail) ----\n${log.slice(-8000)}`)
  if (log.includes('panicked')) {
    console.log('the server panicked')
    rc = 1
  }
}
for (const sig of ['SIGINT', 'SIGTERM']) {
  process.on(sig, async () => {
    await teardown()
    process.exit(130)
  })
}

try {
  await net.up()
  await server.start()
  const t0 = Date.now()
  const child = spawn(process.execPath, ['--test', '--test-concurrency=2', ...files], {
    cwd: here,
    stdio: 'inherit',
    env: { ...process.env, ...server.sdkEnv(), KILN_JS_SERVER_LOG: server.logPath },
  })
  rc = await new Promise((resolve) => child.on('exit', (code) => resolve(code ?? 1)))
  console.log(`JS SDK tests took ${((Date.now() - t0) / 1000).toFixed(1)} s`)
} catch (e) {
  console.error(e)
  rc = 1
} finally {
  await teardown()
}
process.exit(rc)
