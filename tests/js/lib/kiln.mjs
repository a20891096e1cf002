// A real `kiln serve` for the JavaScript SDK tests, started as the Python suite's session
// fixture starts it (tests/sdk/server/conftest.py): `--no-prepare`, loopback on a free port,
// a temporary state dir, the first API key read from its log; and torn down the same way
// (sandboxes killed through the API, then every runsc container, mount, network slot and file
// left under the state dir removed).

import { spawn, spawnSync } from 'node:child_process'
import { existsSync, mkdtempSync, openSync, readFileSync, readdirSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

/** The kiln binary (KILN_BIN, as scripts/test.sh sets it). */
export function kilnBin() {
  const bin = process.env.KILN_BIN
  if (!bin) throw new Error('KILN_BIN is not set: point it at the built `kiln` binary (scripts/test.sh does)')
  if (!existsSync(bin)) throw new Error(`KILN_BIN=${bin} does not exist`)
  return bin
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

export class KilnServer {
  /** `extraArgs`: more `kiln serve` flags (network range, DNS upstream). */
  constructor(extraArgs = []) {
    this.base = mkdtempSync(join(tmpdir(), 'kiln-js-'))
    this.stateDir = join(this.base, 'state')
    this.logPath = join(this.base, 'serve.log')
    this.extraArgs = extraArgs
    this.proc = null
    this.url = null
    this.apiKey = null
  }

  log() {
    try {
      return readFileSync(this.logPath, 'utf8')
    } catch {
      return ''
    }
  }

  async start(timeoutMs = 60_000) {
    const out = openSync(this.logPath, 'a')
    this.proc = spawn(
      kilnBin(),
      ['serve', '--no-prepare', '--listen', '127.0.0.1:0', '--state-dir', this.stateDir, ...this.extraArgs],
      { stdio: ['ignore', out, out], env: { ...process.env, KILN_LOG: process.env.KILN_LOG || 'info', NO_COLOR: '1' } },
    )
    let exited = null
    this.proc.on('exit', (code, signal) => (exited = code ?? signal))
    const deadline = Date.now() + timeoutMs
    while (Date.now() < deadline) {
      const text = this.log()
      const m = text.match(/listening on (http:\/\/[0-9.:]+)/)
      if (m && text.includes('SDK settings')) {
        this.url = m[1]
        this.apiKey = text.match(/first API key \(shown once, store it now\): (e2b_[0-9a-f]+)/)?.[1]
        if (!this.apiKey) throw new Error(`kiln serve printed no API key:\n${text}`)
        return this
      }
      if (exited !== null) throw new Error(`kiln serve exited with ${exited}:\n${text}`)
      await sleep(50)
    }
    throw new Error(`kiln serve did not start within ${timeoutMs / 1000}s:\n${this.log()}`)
  }

  /** The environment the e2b SDK reads (header mode: one URL for the API and the sandboxes). */
  sdkEnv() {
    return { E2B_API_URL: this.url, E2B_SANDBOX_URL: this.url, E2B_API_KEY: this.apiKey }
  }

  async killAllSandboxes() {
    if (!this.url || !this.proc || this.proc.exitCode !== null) return
    try {
      const headers = { 'X-API-Key': this.apiKey }
      const r = await fetch(`${this.url}/sandboxes`, { headers })
      if (r.status !== 200) return
      for (const s of await r.json()) {
        await fetch(`${this.url}/sandboxes/${s.sandboxID}`, { method: 'DELETE', headers })
      }
    } catch (e) {
      console.error(`cleanup: listing sandboxes: ${e}`)
    }
  }

  async stop() {
    if (!this.proc || this.proc.exitCode !== null || this.proc.signalCode !== null) return
    const gone = new Promise((r) => this.proc.once('exit', r))
    this.proc.kill('SIGTERM')
    if (!(await Promise.race([gone.then(() => true), sleep(10_000).then(() => false)]))) {
      this.proc.kill('SIGKILL')
      await gone
    }
  }

  /** Stops the server and removes everything it left; returns its log. */
  async teardown() {
    await this.killAllSandboxes()
    await this.stop()
    const log = this.log()
    cleanupState(this.stateDir)
    rmSync(this.base, { recursive: true, force: true })
    return log
  }
}

function run(...args) {
  return spawnSync(args[0], args.slice(1), { encoding: 'utf8', timeout: 60_000 })
}

/** Removes every runsc container, mount and network slot a kiln server left under stateDir. */
export function cleanupState(stateDir) {
  const root = join(stateDir, 'gvisor', 'runsc')
  if (existsSync(root)) {
    const runsc = process.env.KILN_RUNSC || 'runsc'
    try {
      const list = JSON.parse(run(runsc, `--root=${root}`, 'list', '--format=json').stdout || '[]') || []
      for (const c of list) {
        run(runsc, `--root=${root}`, '--network=none', '--host-uds=create', 'delete', '--force', c.id)
      }
    } catch (e) {
      console.error(`cleanup: runsc: ${e}`)
    }
  }
  const mounts = readFileSync('/proc/self/mountinfo', 'utf8')
    .split('\n')
    .map((l) => l.split(' ')[4])
    .filter((mp) => mp && mp.startsWith(stateDir))
  for (const mp of mounts.reverse()) run('umount', '-l', mp)
  removeNetSlots(stateDir)
  rmSync(stateDir, { recursive: true, force: true })
}

/** The name prefix of the network slots of the server with `stateDir` (kiln_net's prefix_for
 * over `<state>/gvisor`: FNV-1a, low 16 bits). */
export function netPrefix(stateDir) {
  let h = 0x811c9dc5
  for (const b of Buffer.from(join(stateDir, 'gvisor'))) {
    h = Math.imul(h ^ b, 0x01000193) >>> 0
  }
  return 'k' + (h & 0xffff).toString(16).padStart(4, '0')
}

function removeNetSlots(stateDir) {
  const p = netPrefix(stateDir)
  if (existsSync('/run/netns')) {
    for (const ns of readdirSync('/run/netns')) if (ns.startsWith(p + '-')) run('ip', 'netns', 'del', ns)
  }
  for (const dev of readdirSync('/sys/class/net')) if (dev.startsWith(p + 'h')) run('ip', 'link', 'del', dev)
  run('nft', 'delete', 'table', 'ip', `kiln_${p}`)
}
