"""The Template API behind `kiln serve --tls-cert/--tls-key` (the fixtures of
test_server_tls.py: the SDK with E2B_DOMAIN alone, in a network namespace, trusting a test CA):
the upload URL of `GET /templates/{id}/files/{hash}` says `https://` and the host the client
used, so `Template.build` with a COPY uploads over TLS and the template starts. Needs root."""

import json
import os
import subprocess
import sys
import textwrap

from .test_server_tls import DOMAIN, NS, client_ns, tls_server  # noqa: F401 (fixtures)

CLIENT = textwrap.dedent("""
    import json, os, sys, urllib.request, uuid
    from e2b import Sandbox, Template
    out = {}
    name = "kt-tls-" + uuid.uuid4().hex[:6]
    tpl = (Template(file_context_path=sys.argv[1]).from_template("base")
           .copy("data.txt", "/home/user/data.txt"))
    info = Template.build(tpl, name)
    req = urllib.request.Request(
        f"https://api.{os.environ['E2B_DOMAIN']}/templates/{info.template_id}/files/{'ab' * 32}",
        headers={"X-API-Key": os.environ["E2B_API_KEY"]})
    out["link"] = json.loads(urllib.request.urlopen(req, timeout=30).read())["url"]
    sbx = Sandbox.create(name, timeout=60)
    try:
        out["data"] = sbx.commands.run("cat /home/user/data.txt").stdout.strip()
    finally:
        sbx.kill()
    print("RESULT " + json.dumps(out))
""")


def test_upload_urls_follow_the_servers_scheme(tls_server, tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "data.txt").write_text("uploaded over tls\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": tls_server["key"],
                "SSL_CERT_FILE": tls_server["ca"]})
    r = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", CLIENT, str(ctx)],
                       capture_output=True, text=True, env=env, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"client failed:\n{r.stdout}\n{r.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["link"].startswith(f"https://api.{DOMAIN}/template-files/"), out
    assert out["data"] == "uploaded over tls", out
