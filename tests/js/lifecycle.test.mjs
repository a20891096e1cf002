// Sandbox lifecycle through the pinned e2b JavaScript SDK: pause and connect (memory kept),
// auto-pause with autoResume, setTimeout(0), snapshots, fork, and Sandbox.list paging (newest
// first, with nextToken, by state).

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { test } from 'node:test'

import { Sandbox } from 'e2b'

import { sleep, waitFor } from './lib/sandbox.mjs'

const COUNTER = "bash -c 'i=0; while :; do i=$((i+1)); echo $i > /home/user/count; sleep 0.1; done'"

/** The counter's current value (it may be caught mid-write, or not yet written by a counter
 * that has just started: read again). */
async function count(sbx) {
  return waitFor(async () => {
    let t
    try {
      t = (await sbx.files.read('/home/user/count')).trim()
    } catch (e) {
      if (e.name === 'FileNotFoundError') return 0
      throw e
    }
    return /^\d+$/.test(t) ? Number(t) : 0
  }, 'the counter')
}

/** Asserts the counter of `sbx` is moving. */
async function assertCounting(sbx, why) {
  const c = await count(sbx)
  await waitFor(async () => (await count(sbx)) > c, why)
}

async function killAll(list) {
  for (const s of list) if (s && !(s instanceof Error)) await s.kill().catch(() => {})
}

const state = async (id) => (await Sandbox.getInfo(id)).state

test('pause and connect keep memory; setTimeout(0) applies the timeout action now', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  const pausing = await Sandbox.create({ timeoutMs: 120_000, lifecycle: { onTimeout: 'pause', autoResume: false } })
  const plain = await Sandbox.create({ timeoutMs: 120_000 })
  try {
    await sbx.commands.run(COUNTER, { background: true })
    await sbx.files.write('/tmp/in-memory', 'tmpfs')
    await assertCounting(sbx, 'the counter to run')
    assert.equal(await sbx.pause(), true)
    assert.equal(await state(sbx.sandboxId), 'paused')
    assert.equal(await sbx.isRunning(), false)
    const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 60_000 })
    assert.equal(await state(sbx.sandboxId), 'running')
    // The process and the sandbox's tmpfs came back with the memory.
    assert.equal(await again.files.read('/tmp/in-memory'), 'tmpfs')
    await assertCounting(again, 'the counter after resume')

    // setTimeout(0): without auto-pause the sandbox ends at once, with it it pauses.
    await plain.setTimeout(0)
    assert.equal(await plain.isRunning(), false)
    await assert.rejects(Sandbox.getInfo(plain.sandboxId), /not found/i)
    await pausing.files.write('/tmp/mark', 'kept')
    await pausing.setTimeout(0)
    assert.equal(await state(pausing.sandboxId), 'paused')
    const resumed = await pausing.connect({ timeoutMs: 60_000 })
    assert.equal(await resumed.files.read('/tmp/mark'), 'kept')
  } finally {
    await killAll([sbx, pausing, plain])
  }
})

test('auto-pause on timeout, then autoResume on traffic', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 3_000, lifecycle: { onTimeout: 'pause', autoResume: true } })
  try {
    await sbx.files.write('/tmp/mark', 'before the auto-pause')
    await waitFor(async () => (await state(sbx.sandboxId)) === 'paused', 'the auto-pause', 30_000)
    // Envd traffic to the paused sandbox resumes it transparently.
    assert.equal(await sbx.files.read('/tmp/mark'), 'before the auto-pause')
    assert.equal(await state(sbx.sandboxId), 'running')
  } finally {
    await killAll([sbx])
  }
})

test('snapshots: create, list, start sandboxes from one, delete', async () => {
  const name = `js-snap-${randomUUID().slice(0, 8)}`
  const src = await Sandbox.create({ timeoutMs: 120_000, envs: { KEPT: 'in-snapshot' } })
  const made = []
  let snap
  try {
    await src.commands.run(COUNTER, { background: true })
    await src.files.write('/home/user/notes.txt', 'captured')
    await assertCounting(src, 'the counter to run')
    snap = await src.createSnapshot({ name })
    assert.ok(snap.snapshotId.endsWith(':default'), snap.snapshotId)
    assert.deepEqual(snap.names, [`${name}:default`])
    await assertCounting(src, 'the source to keep running')
    const pages = src.listSnapshots()
    const listed = []
    while (pages.hasNext) listed.push(...(await pages.nextItems()))
    assert.deepEqual(listed.map((s) => s.snapshotId), [snap.snapshotId])
    await src.kill()

    // From the snapshot by id and by name, after its source is gone.
    for (const template of [snap.snapshotId, name]) {
      const sbx = await Sandbox.create(template, { timeoutMs: 120_000 })
      made.push(sbx)
      assert.equal(await sbx.files.read('/home/user/notes.txt'), 'captured')
      assert.equal((await sbx.commands.run('echo $KEPT')).stdout, 'in-snapshot\n')
      await assertCounting(sbx, "the snapshot's process to run")
    }
    await made[0].files.write('/home/user/notes.txt', "first's own")
    assert.equal(await made[1].files.read('/home/user/notes.txt'), 'captured')
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
    snap = null
  } finally {
    await killAll([src, ...made])
    if (snap) await Sandbox.deleteSnapshot(snap.snapshotId).catch(() => {})
  }
})

test('fork: two children start from the parent and diverge', async () => {
  const parent = await Sandbox.create({ timeoutMs: 120_000 })
  let children = []
  try {
    await parent.commands.run(COUNTER, { background: true })
    await parent.files.write('/home/user/notes.txt', 'parent')
    await assertCounting(parent, 'the counter to run')
    children = await parent.fork({ count: 2, timeoutMs: 120_000 })
    assert.equal(children.length, 2)
    assert.ok(children.every((c) => c instanceof Sandbox), String(children))
    assert.equal(new Set([parent, ...children].map((s) => s.sandboxId)).size, 3)
    for (const [i, child] of children.entries()) {
      assert.equal(await child.files.read('/home/user/notes.txt'), 'parent')
      await assertCounting(child, "the child's copy of the counter")
      await child.files.write('/home/user/notes.txt', `child ${i}`)
    }
    for (const [i, child] of children.entries()) {
      assert.equal(await child.files.read('/home/user/notes.txt'), `child ${i}`)
    }
    assert.equal(await parent.files.read('/home/user/notes.txt'), 'parent')
    await assertCounting(parent, 'the parent to keep running')
  } finally {
    await killAll([parent, ...children])
  }
})

/** Every page of `Sandbox.list(opts)`, as lists of ids (checking each page's size). */
async function pages(opts) {
  const pager = Sandbox.list(opts)
  const out = []
  while (pager.hasNext) {
    const page = await pager.nextItems()
    assert.ok(page.length <= opts.limit, `a page of ${page.length} > limit ${opts.limit}`)
    out.push(...page.map((s) => s.sandboxId))
  }
  return out
}

test('Sandbox.list pages newest first with nextToken, by state, never repeating', async () => {
  const tag = randomUUID()
  const made = []
  try {
    for (let i = 0; i < 3; i++) {
      made.push(await Sandbox.create({ timeoutMs: 120_000, metadata: { page: tag } }))
      await sleep(20)
    }
    await made[1].pause()
    const ids = made.map((s) => s.sandboxId)
    const newestFirst = [...ids].reverse()
    const metadata = { page: tag }
    assert.deepEqual(await pages({ query: { metadata, state: ['running', 'paused'] }, limit: 1 }), newestFirst)
    assert.deepEqual(await pages({ query: { metadata, state: ['paused'] }, limit: 1 }), [ids[1]])
    assert.deepEqual(await pages({ query: { metadata, state: ['running'] }, limit: 1 }), [ids[2], ids[0]])
    assert.deepEqual(await pages({ query: { metadata, state: ['running', 'paused'] }, limit: 2 }), newestFirst)
    // Oldest first on request, and a token handed to a new paginator goes on from there.
    assert.deepEqual(await pages({ query: { metadata, state: ['running', 'paused'] }, order: 'asc', limit: 1 }), ids)
    const first = Sandbox.list({ query: { metadata }, limit: 1 })
    assert.deepEqual((await first.nextItems()).map((s) => s.sandboxId), [ids[2]])
    assert.ok(first.nextToken)
    const rest = await pages({ query: { metadata, state: ['running', 'paused'] }, limit: 1, nextToken: first.nextToken })
    assert.deepEqual(rest, [ids[1], ids[0]])
    // The listed info is the SDK's shape.
    const [info] = await Sandbox.list({ query: { metadata, state: ['paused'] } }).nextItems()
    assert.equal(info.state, 'paused')
    assert.equal(info.templateId, 'base')
    assert.deepEqual(info.metadata, metadata)
    assert.ok(info.startedAt instanceof Date && info.startedAt <= new Date())
  } finally {
    await killAll(made)
  }
})
