// Files through the pinned e2b JavaScript SDK: text and bytes, list, exists, getInfo (symlinks
// too), makeDir, rename, remove, file metadata (write, list, getInfo, rename, overwrite), and
// watchDir's event sequences (envd's three events for a write).

import assert from 'node:assert/strict'
import { test } from 'node:test'

import { FileType, FilesystemEventType as T, NotFoundError } from 'e2b'

import { sleep, waitFor, withSandbox } from './lib/sandbox.mjs'

test('read, write, list, exists, getInfo, makeDir, rename, remove', () =>
  withSandbox(async (sbx) => {
    const d = '/home/user/js'
    const w = await sbx.files.write(`${d}/hello.txt`, 'hello from js')
    assert.equal(w.path, `${d}/hello.txt`)
    assert.equal(w.name, 'hello.txt')
    assert.equal(w.type, FileType.FILE)
    assert.equal(await sbx.files.read(`${d}/hello.txt`), 'hello from js')
    // Bytes round-trip exactly, all 256 values.
    const bytes = Uint8Array.from({ length: 256 }, (_, i) => i)
    await sbx.files.write(`${d}/bin`, bytes.buffer)
    assert.deepEqual(await sbx.files.read(`${d}/bin`, { format: 'bytes' }), bytes)
    assert.equal((await sbx.commands.run(`wc -c < ${d}/bin`)).stdout, '256\n')
    // A file written inside the sandbox reads through the SDK, and the other way round.
    await sbx.commands.run(`printf inside > ${d}/in.txt`)
    assert.equal(await sbx.files.read(`${d}/in.txt`), 'inside')
    assert.equal((await sbx.commands.run(`cat ${d}/hello.txt`)).stdout, 'hello from js')

    assert.equal(await sbx.files.makeDir(`${d}/sub/deeper`), true)
    assert.equal(await sbx.files.makeDir(`${d}/sub/deeper`), false)
    const listed = await sbx.files.list(d)
    assert.deepEqual(listed.map((e) => [e.name, e.type]).sort(), [
      ['bin', FileType.FILE], ['hello.txt', FileType.FILE], ['in.txt', FileType.FILE], ['sub', FileType.DIR],
    ])
    const deep = (await sbx.files.list(d, { depth: 2 })).map((e) => e.path)
    assert.ok(deep.includes(`${d}/sub/deeper`), deep)

    const info = await sbx.files.getInfo(`${d}/hello.txt`)
    assert.equal(info.size, 13)
    assert.equal(info.owner, 'user')
    assert.equal(info.permissions, '-rw-r--r--')
    assert.ok(info.modifiedTime instanceof Date && Math.abs(info.modifiedTime - Date.now()) < 120_000)
    assert.equal(await sbx.files.exists(`${d}/hello.txt`), true)
    assert.equal(await sbx.files.exists(`${d}/nope`), false)
    await assert.rejects(sbx.files.read(`${d}/nope`), NotFoundError)

    const moved = await sbx.files.rename(`${d}/hello.txt`, `${d}/sub/moved.txt`)
    assert.equal(moved.path, `${d}/sub/moved.txt`)
    assert.equal(await sbx.files.read(`${d}/sub/moved.txt`), 'hello from js')
    assert.equal(await sbx.files.exists(`${d}/hello.txt`), false)
    await sbx.files.remove(`${d}/sub`)
    assert.equal(await sbx.files.exists(`${d}/sub/moved.txt`), false)
    assert.equal((await sbx.commands.run(`test -e ${d}/sub || echo gone`)).stdout, 'gone\n')
  }))

test('symlinks: getInfo and list show the target\'s type, the target and its size', () =>
  withSandbox(async (sbx) => {
    await sbx.commands.run(
      'mkdir -p /home/user/ln/dir && printf 12345 > /home/user/ln/file.txt && ' +
        'ln -s /home/user/ln/file.txt /home/user/ln/to-file && ln -s dir /home/user/ln/to-dir',
    )
    const info = await sbx.files.getInfo('/home/user/ln/to-file')
    // The JS SDK maps envd's type (the target's) and leaves `isSymlink` aside: a link to a
    // file is a file with a `symlinkTarget`.
    assert.equal(info.type, FileType.FILE)
    assert.equal(info.symlinkTarget, '/home/user/ln/file.txt')
    assert.equal(info.size, 5)
    const listed = Object.fromEntries((await sbx.files.list('/home/user/ln')).map((e) => [e.name, e]))
    assert.equal(listed['to-dir'].type, FileType.DIR)
    assert.equal(listed['to-dir'].symlinkTarget, '/home/user/ln/dir')
    assert.equal(listed['file.txt'].type, FileType.FILE)
    assert.equal(listed['file.txt'].symlinkTarget, undefined)
    // Reading through the link reads the target.
    assert.equal(await sbx.files.read('/home/user/ln/to-file'), '12345')
  }))

test('metadata: on write, getInfo, list and rename; replaced or cleared by an overwrite', () =>
  withSandbox(async (sbx) => {
    const want = { 'owner-team': 'kiln', stage: 'js' }
    const w = await sbx.files.write('/home/user/meta/a.txt', 'a', { metadata: { 'Owner-Team': 'kiln', stage: 'js' } })
    assert.deepEqual(w.metadata, want)
    assert.deepEqual((await sbx.files.getInfo('/home/user/meta/a.txt')).metadata, want)
    assert.deepEqual(
      (await sbx.files.list('/home/user/meta')).map((e) => [e.name, e.metadata]),
      [['a.txt', want]],
    )
    assert.deepEqual((await sbx.files.rename('/home/user/meta/a.txt', '/home/user/meta/b.txt')).metadata, want)
    await sbx.files.rename('/home/user/meta', '/home/user/meta2')
    assert.deepEqual((await sbx.files.getInfo('/home/user/meta2/b.txt')).metadata, want)
    await sbx.files.write('/home/user/meta2/b.txt', 'b', { metadata: { k: 'v' } })
    assert.deepEqual((await sbx.files.getInfo('/home/user/meta2/b.txt')).metadata, { k: 'v' })
    await sbx.files.write('/home/user/meta2/b.txt', 'c')
    assert.equal((await sbx.files.getInfo('/home/user/meta2/b.txt')).metadata, undefined)
    // xattrs set inside the sandbox show up where the file system has them (gVisor's tmpfs);
    // on the sandbox's disk gVisor refuses user xattrs (docs/file-metadata.md).
    const setx = (p) =>
      sbx.commands.run(`echo t > ${p} && python3 -c "import os; os.setxattr('${p}', 'user.e2b.color', b'blue')"`)
    await setx('/tmp/x')
    assert.deepEqual((await sbx.files.getInfo('/tmp/x')).metadata, { color: 'blue' })
    await assert.rejects(setx('/home/user/x'), (e) => /Operation not supported/.test(e.stderr))
    // A multi-file write puts it on every file.
    const infos = await sbx.files.write(
      [{ path: '/home/user/m/x', data: 'x' }, { path: '/home/user/m/y', data: 'y' }],
      { metadata: { batch: '1' } },
    )
    assert.deepEqual(infos.map((i) => i.metadata), [{ batch: '1' }, { batch: '1' }])
    assert.deepEqual((await sbx.files.getInfo('/home/user/m/y')).metadata, { batch: '1' })
  }))

/** The (name, type) pairs `events` holds once `count` arrived and 300 ms passed without more. */
async function take(events, count) {
  await waitFor(() => events.length >= count, `${count} watch events (got ${JSON.stringify(events)})`)
  await sleep(300)
  return events.splice(0).map((e) => [e.name, e.type])
}

test('watchDir: envd event sequences for writes, chmod, rename, remove, recursive', () =>
  withSandbox(async (sbx) => {
    const d = '/home/user/watched'
    await sbx.files.makeDir(d)
    const events = []
    const handle = await sbx.files.watchDir(d, (e) => events.push(e), { recursive: true })
    try {
      // A new file written through the API: create, the chown to the writer, the data.
      await sbx.files.write(`${d}/new.txt`, 'x')
      assert.deepEqual(await take(events, 3), [['new.txt', T.CREATE], ['new.txt', T.CHMOD], ['new.txt', T.WRITE]])
      await sbx.files.write(`${d}/new.txt`, 'y')
      assert.deepEqual(await take(events, 3), [['new.txt', T.WRITE], ['new.txt', T.CHMOD], ['new.txt', T.WRITE]])
      await sbx.commands.run(`chmod 600 ${d}/new.txt`)
      assert.deepEqual(await take(events, 1), [['new.txt', T.CHMOD]])
      await sbx.files.rename(`${d}/new.txt`, `${d}/renamed.txt`)
      assert.deepEqual(await take(events, 2), [['new.txt', T.RENAME], ['renamed.txt', T.CREATE]])
      await sbx.files.remove(`${d}/renamed.txt`)
      assert.deepEqual(await take(events, 1), [['renamed.txt', T.REMOVE]])
      // Recursive: a new directory is watched too; names are relative to the watched one.
      await sbx.files.makeDir(`${d}/sub`)
      assert.deepEqual((await take(events, 1))[0], ['sub', T.CREATE])
      await sbx.files.write(`${d}/sub/f.txt`, 'z')
      assert.deepEqual(await take(events, 3), [['sub/f.txt', T.CREATE], ['sub/f.txt', T.CHMOD], ['sub/f.txt', T.WRITE]])
    } finally {
      await handle.stop()
    }
    // Once stopped, no more events arrive.
    await sbx.files.write(`${d}/after.txt`, 'late')
    await sleep(300)
    assert.deepEqual(events, [])
  }))
