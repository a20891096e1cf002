"""`Idempotency-Key` across a server restart: a create retried after `kill serve; serve` on the
same state directory gets the first answer (the same sandbox, `Idempotent-Replayed: true`), no
second sandbox starts, and the key with another body is still refused (422)."""

import os


from .conftest import KilnServer


def test_a_create_retried_after_a_restart_returns_the_same_sandbox(state_dir):
    extra = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split()
    first = KilnServer(state_dir, extra).start()
    second = None
    key = {"Idempotency-Key": "create-across-a-restart"}
    body = {"templateID": "base", "timeout": 120}
    try:
        status, created, _ = first.request("POST", "/sandboxes", body, headers=key)
        assert status == 201, created
        sid = created["sandboxID"]
        first.stop()

        second = KilnServer(state_dir, extra)
        second.api_key = first.api_key
        second.url = first.url
        second.start()
        status, again, headers = second.request("POST", "/sandboxes", body, headers=key)
        assert status == 201, again
        assert again["sandboxID"] == sid, (created, again)
        assert headers.get("Idempotent-Replayed") == "true", dict(headers)
        status, listed, _ = second.request("GET", "/sandboxes")
        assert status == 200, listed
        assert [s["sandboxID"] for s in listed] in ([], [sid]), listed
        other = {"templateID": "base", "timeout": 60}
        status, err, _ = second.request("POST", "/sandboxes", other, headers=key)
        assert status == 422, err
    finally:
        for s in (second, first):
            if s is not None:
                s.kill_all_sandboxes()
                s.stop()
