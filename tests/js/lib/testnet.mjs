// The JavaScript suite's test "internet", built on this machine: network namespace `ktjs`
// joined to the host by the veth pair ktjs0/eth0, two HTTP hosts on 198.51.100.144/29 (a
// documentation range no other suite uses) that answer with their own name. Nothing here sends
// traffic anywhere else. Needs root.

import { spawn, spawnSync } from 'node:child_process'
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'

const NS = 'ktjs'
const HOST_DEV = 'ktjs0'
export const HOST_SIDE = '198.51.100.145'
export const HOSTS = { '198.51.100.146': 'one', '198.51.100.147': 'two' }

// An HTTP server answering every request with argv[2]: node's own, so the suite needs no other
// runtime.
const HTTP_SERVER = `
  const [ip, body] = process.argv.slice(1)
  require('node:http').createServer((_, res) => res.end(body)).listen(80, ip)
`

function sh(...args) {
  return spawnSync(args[0], args.slice(1), { encoding: 'utf8' })
}

function must(...args) {
  const r = sh(...args)
  if (r.status !== 0) throw new Error(`${args.join(' ')}: ${r.stderr}`)
  return r
}

export class TestNet {
  constructor() {
    this.procs = []
  }

  async up() {
    if (process.getuid() !== 0) throw new Error('the network tests need root (network namespaces)')
    this.down()
    must('ip', 'netns', 'add', NS)
    must('ip', 'link', 'add', HOST_DEV, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', NS)
    must('ip', 'addr', 'add', `${HOST_SIDE}/29`, 'dev', HOST_DEV)
    must('ip', 'link', 'set', HOST_DEV, 'up')
    for (const ip of Object.keys(HOSTS)) must('ip', '-n', NS, 'addr', 'add', `${ip}/29`, 'dev', 'eth0')
    must('ip', '-n', NS, 'link', 'set', 'eth0', 'up')
    must('ip', '-n', NS, 'link', 'set', 'lo', 'up')
    // Replies to the sandboxes' (NATed) traffic go back through the host.
    must('ip', '-n', NS, 'route', 'add', 'default', 'via', HOST_SIDE)
    mkdirSync(`/etc/netns/${NS}`, { recursive: true })
    writeFileSync(`/etc/netns/${NS}/hosts`, '127.0.0.1 localhost\n')
    for (const [ip, body] of Object.entries(HOSTS)) {
      this.procs.push(
        spawn('ip', ['netns', 'exec', NS, process.execPath, '-e', HTTP_SERVER, ip, body], { stdio: 'ignore' }),
      )
    }
    const deadline = Date.now() + 30_000
    for (const [ip, body] of Object.entries(HOSTS)) {
      for (;;) {
        try {
          const r = await fetch(`http://${ip}/`, { signal: AbortSignal.timeout(2000) })
          if ((await r.text()) === body) break
        } catch {
          // not up yet
        }
        if (Date.now() > deadline) throw new Error(`test host ${ip} did not come up`)
        await new Promise((r) => setTimeout(r, 100))
      }
    }
    return this
  }

  down() {
    for (const p of this.procs) p.kill('SIGKILL')
    this.procs = []
    sh('ip', 'netns', 'del', NS)
    sh('ip', 'link', 'del', HOST_DEV)
    rmSync(`/etc/netns/${NS}`, { recursive: true, force: true })
  }
}
