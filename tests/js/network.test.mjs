// Sandbox networking through the pinned e2b JavaScript SDK: allowOut/denyOut at create and by
// updateNetwork, allowInternetAccess: false, and getHost (a server in the sandbox reached through
// kiln's proxy). The "internet" is run.mjs's test hosts on 198.51.100.144/29; nothing here
// leaves this machine.

import assert from 'node:assert/strict'
import { request } from 'node:http'
import { test } from 'node:test'

import { Sandbox } from 'e2b'

import { waitFor, withSandbox } from './lib/sandbox.mjs'

const ONE = '198.51.100.146' // answers "one"
const TWO = '198.51.100.147' // answers "two"

/** What `url` answers inside the sandbox, or null when it cannot be reached. */
async function fetchIn(sbx, url) {
  try {
    const r = await sbx.commands.run(`curl -s -m 3 ${url}`, { timeoutMs: 30_000 })
    return r.stdout.trim()
  } catch {
    return null
  }
}

test('allowOut/denyOut at create and by updateNetwork', () =>
  withSandbox(
    async (sbx) => {
      assert.equal(await fetchIn(sbx, `http://${ONE}/`), 'one')
      assert.equal(await fetchIn(sbx, `http://${TWO}/`), null)
      assert.deepEqual((await sbx.getInfo()).network?.denyOut, [TWO])
      // Deny everything but TWO while it runs.
      await sbx.updateNetwork({ denyOut: ['0.0.0.0/0'], allowOut: [TWO] })
      assert.equal(await fetchIn(sbx, `http://${TWO}/`), 'two')
      assert.equal(await fetchIn(sbx, `http://${ONE}/`), null)
      // And back to no rules.
      await sbx.updateNetwork({})
      assert.equal(await fetchIn(sbx, `http://${ONE}/`), 'one')
      assert.equal(await fetchIn(sbx, `http://${TWO}/`), 'two')
    },
    { network: { denyOut: [`${TWO}/32`] } },
  ))

test('allowInternetAccess: false reaches nothing', () =>
  withSandbox(
    async (sbx) => {
      assert.equal(await fetchIn(sbx, `http://${ONE}/`), null)
      assert.equal((await Sandbox.getInfo(sbx.sandboxId)).allowInternetAccess, false)
    },
    { allowInternetAccess: false },
  ))

/** (status, body) of GET / on kiln's listener with `host` as the Host header, the way a
 * client that resolves `host` to kiln reaches a sandbox port. */
function getVia(host) {
  const api = new URL(process.env.E2B_API_URL)
  return new Promise((resolve, reject) => {
    const req = request({ host: api.hostname, port: api.port, path: '/index.html', headers: { Host: `${host}:${api.port}` } }, (res) => {
      let body = ''
      res.on('data', (d) => (body += d))
      res.on('end', () => resolve([res.statusCode, body]))
    })
    req.on('error', reject)
    req.end()
  })
}

test('getHost names a sandbox port that kiln proxies', () =>
  withSandbox(async (sbx) => {
    await sbx.commands.run('mkdir -p /tmp/www && echo hi-from-8000 > /tmp/www/index.html')
    await sbx.commands.run('cd /tmp/www && python3 -m http.server 8000', { background: true })
    const host = sbx.getHost(8000)
    assert.equal(host, `8000-${sbx.sandboxId}.${sbx.sandboxDomain}`)
    assert.equal(sbx.sandboxDomain, 'localhost')
    const [status, body] = await waitFor(async () => {
      const r = await getVia(host)
      return r[0] === 200 ? r : null
    }, 'the server in the sandbox')
    assert.equal(status, 200)
    assert.equal(body, 'hi-from-8000\n')
    // Another port of the same sandbox has nothing listening.
    const [other] = await getVia(sbx.getHost(8001))
    assert.equal(other, 502)
  }))
