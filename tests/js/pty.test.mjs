// PTYs through the pinned e2b JavaScript SDK: create (size, env, cwd), sendInput, resize, the
// terminal's output, kill.

import assert from 'node:assert/strict'
import { test } from 'node:test'

import { waitFor, withSandbox } from './lib/sandbox.mjs'

test('pty: create, sendInput, resize, output, exit and kill', () =>
  withSandbox(async (sbx) => {
    let out = ''
    const dec = new TextDecoder()
    const term = await sbx.pty.create({
      cols: 80,
      rows: 24,
      envs: { PTY_VAR: 'from-js' },
      cwd: '/tmp',
      onData: (d) => (out += dec.decode(d, { stream: true })),
    })
    assert.ok(term.pid > 0)
    const enc = new TextEncoder()
    const send = (s) => sbx.pty.sendInput(term.pid, enc.encode(s))

    // The shell runs on a terminal of the asked size, with the env, in the cwd.
    await send('echo "size=$(stty size) tty=$(tty) env=$PTY_VAR cwd=$PWD term=$TERM"\n')
    await waitFor(() => /size=24 80 tty=\/dev\/pts\/\d+ env=from-js cwd=\/tmp term=xterm-256color/.test(out), `the pty's answer (got ${JSON.stringify(out)})`)
    await sbx.pty.resize(term.pid, { cols: 132, rows: 40 })
    await send('echo "now=$(stty size)"\n')
    await waitFor(() => out.includes('now=40 132'), `the resized size (got ${JSON.stringify(out)})`)
    // Input goes through the line discipline: ^C interrupts a foreground command.
    await send('sleep 600\n')
    await waitFor(async () => (await sbx.commands.run('pgrep -x sleep || true')).stdout.trim(), 'sleep to run')
    await send('\x03')
    await send('echo after-interrupt\n')
    await waitFor(() => /\rafter-interrupt\r\n/.test(out), `the shell after ^C (got ${JSON.stringify(out)})`)

    // `exit` ends the PTY with the shell's code.
    await send('exit 7\n')
    const res = await term.wait().catch((e) => e)
    assert.equal(res.exitCode, 7)

    // A second PTY is killed from outside.
    const other = await sbx.pty.create({ cols: 40, rows: 10, onData: () => {} })
    assert.equal(await sbx.pty.kill(other.pid), true)
    const killed = await other.wait().catch((e) => e)
    assert.notEqual(killed.exitCode, 0)
  }))
