// Commands through the pinned e2b JavaScript SDK: run, exit codes and CommandExitError, env,
// cwd, user, streaming callbacks, background handles, stdin, list/connect and kill.

import assert from 'node:assert/strict'
import { test } from 'node:test'

import { CommandExitError } from 'e2b'

import { waitFor, withSandbox } from './lib/sandbox.mjs'

test('run: output, env, cwd, user, exit codes', () =>
  withSandbox(async (sbx) => {
    const r = await sbx.commands.run('echo out; echo err >&2; pwd; whoami; echo "$GREETING"', {
      envs: { GREETING: 'hello from js' },
      cwd: '/tmp',
    })
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'out\n/tmp\nuser\nhello from js\n')
    assert.equal(r.stderr, 'err\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')

    // A non-zero exit is a CommandExitError carrying the result.
    await assert.rejects(sbx.commands.run('echo partial; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError, e)
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'partial\n')
      return true
    })
    // Streaming callbacks see the output as it comes.
    const seen = []
    await sbx.commands.run('for i in 1 2 3; do echo line$i; done; echo e >&2', {
      onStdout: (d) => seen.push(['out', d]),
      onStderr: (d) => seen.push(['err', d]),
    })
    assert.equal(seen.filter(([k]) => k === 'out').map(([, d]) => d).join(''), 'line1\nline2\nline3\n')
    assert.deepEqual(seen.filter(([k]) => k === 'err'), [['err', 'e\n']])
  }))

test('background: handle, list, connect, stdin, kill', () =>
  withSandbox(async (sbx) => {
    // A background command's output is there once it ends.
    const bg = await sbx.commands.run('sleep 0.3; echo done-bg', { background: true })
    assert.ok(bg.pid > 0)
    const res = await bg.wait()
    assert.equal(res.stdout, 'done-bg\n')
    assert.equal(res.exitCode, 0)

    // stdin: what is sent comes back; closing it ends `cat`.
    const cat = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(cat.pid, 'to stdin\n')
    await waitFor(() => cat.stdout === 'to stdin\n', 'cat to echo its stdin')
    assert.ok(sbx.commands.supportsStdinClose, 'the agent reports an envd version with closeStdin')
    await sbx.commands.closeStdin(cat.pid)
    assert.equal((await cat.wait()).stdout, 'to stdin\n')

    // A long-running command is listed, can be connected to from elsewhere, and killed.
    const long = await sbx.commands.run('echo started; sleep 600', { background: true })
    await waitFor(() => long.stdout === 'started\n', 'the background command to start')
    const listed = await sbx.commands.list()
    assert.ok(listed.some((p) => p.pid === long.pid && `${p.cmd} ${p.args.join(' ')}`.includes('sleep 600')), JSON.stringify(listed))
    const again = await sbx.commands.connect(long.pid)
    assert.equal(await sbx.commands.kill(long.pid), true)
    await assert.rejects(again.wait(), (e) => {
      assert.ok(e instanceof CommandExitError, e)
      assert.notEqual(e.exitCode, 0)
      return true
    })
    await waitFor(async () => !(await sbx.commands.list()).some((p) => p.pid === long.pid), 'the killed command to go')
    // Killing what is gone says so.
    assert.equal(await sbx.commands.kill(long.pid), false)
  }))
