"""`sudo` in a sandbox (gVisor forces no_new_privs, so kiln brokers it through the agent)."""

import pytest
from e2b import CommandExitException


def test_sudo_becomes_root_and_other_users(sandbox):
    assert sandbox.commands.run("id -un").stdout.strip() == "user"
    assert sandbox.commands.run("sudo id -u").stdout.strip() == "0"
    assert sandbox.commands.run("sudo -n true && echo ok").stdout.strip() == "ok"
    assert sandbox.commands.run("sudo -u user id -un").stdout.strip() == "user"
    r = sandbox.commands.run("sudo sh -c 'echo $(id -u) $HOME $SUDO_USER; pwd'", cwd="/tmp")
    assert r.stdout.split("\n")[:2] == ["0 /root user", "/tmp"]
    # What E2B users do first: install a package as root.
    assert "apt" in sandbox.commands.run("sudo apt-get --version").stdout
    # Writes as root land as root.
    sandbox.commands.run("sudo touch /etc/kiln-sudo-test")
    assert sandbox.commands.run("stat -c %U /etc/kiln-sudo-test").stdout.strip() == "root"
    # stdin, exit codes and signals pass through.
    assert sandbox.commands.run("echo piped | sudo cat").stdout == "piped\n"
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("sudo sh -c 'exit 7'")
    assert ei.value.exit_code == 7
    r = sandbox.commands.run("sudo sh -c 'kill -TERM $$'; echo status=$?")
    assert r.stdout.strip() == "status=143"
    # env_reset: the caller's variables do not pass, -E keeps them.
    r = sandbox.commands.run("sudo env | grep -c SECRET_X || true", envs={"SECRET_X": "1"})
    assert r.stdout.strip() == "0"
    r = sandbox.commands.run("sudo -E env | grep SECRET_X", envs={"SECRET_X": "1"})
    assert r.stdout.strip() == "SECRET_X=1"


def test_non_sudoers_are_refused(sandbox):
    sandbox.commands.run("useradd -m eve", user="root")
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("sudo id -u", user="eve")
    assert ei.value.exit_code == 1
    assert "not allowed" in ei.value.stderr
    # A rule that needs a password is refused (there is no password to give).
    sandbox.commands.run(
        "echo 'eve ALL=(ALL) ALL' > /etc/sudoers.d/eve && chmod 440 /etc/sudoers.d/eve",
        user="root",
    )
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("sudo -n id -u", user="eve")
    assert "password is required" in ei.value.stderr
    # Root may always.
    assert sandbox.commands.run("sudo -u eve id -un", user="root").stdout.strip() == "eve"


def test_a_signal_to_sudo_reaches_its_command(sandbox):
    script = ("rm -f /tmp/sudo-ready; "
              "sudo sh -c 'trap \"echo got-term; exit 7\" TERM; touch /tmp/sudo-ready; "
              "while :; do sleep 0.1; done' & pid=$!; "
              "while [ ! -e /tmp/sudo-ready ]; do sleep 0.05; done; "
              "kill -TERM $pid; wait $pid; echo status=$?")
    r = sandbox.commands.run(script, timeout=30)
    assert "got-term" in r.stdout and "status=7" in r.stdout, r.stdout


def test_killing_sudo_kills_its_command(sandbox):
    h = sandbox.commands.run("sudo sleep 1000", background=True)
    import time

    for _ in range(100):
        if "sleep 1000" in sandbox.commands.run("ps -eo args").stdout:
            break
        time.sleep(0.05)
    h.kill()
    for _ in range(100):
        if "sleep 1000" not in sandbox.commands.run("ps -eo args").stdout:
            break
        time.sleep(0.05)
    assert "sleep 1000" not in sandbox.commands.run("ps -eo args").stdout
