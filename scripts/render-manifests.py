#!/usr/bin/env python3
"""The plain Kubernetes manifests in deploy/kubernetes/ are the Helm chart deploy/helm/kiln
rendered for a release named `kiln` in the namespace `kiln` (the namespace made with it, the
secrets as placeholders to replace). Edit the chart, then run this to write them again;
`--check` writes nothing and fails when the files differ from the chart's rendering.

Renders offline with Helm's own Go SDK (PyPI's helm-python-sdk, in the test venv:
tests/sdk/requirements.txt), so no `helm` binary is needed.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kiln"
OUT = ROOT / "deploy" / "kubernetes"

# The values the plain manifests are rendered with.
VALUES = {
    "namespace": {"create": True},
    "clusterSecret": {"value": "replace-me-with-openssl-rand-hex-24"},
    "s3": {"accessKeyId": "replace-me", "secretAccessKey": "replace-me"},
}
RELEASE = "kiln"
NAMESPACE = "kiln"

HEADER = (
    "# Rendered from the Helm chart deploy/helm/kiln by scripts/render-manifests.py (release\n"
    "# `kiln`, namespace `kiln`): edit the chart and render again, not this file.\n"
)
SECRET_NOTE = (
    "# The values below are placeholders: create the Secrets with kubectl instead of applying\n"
    "# this file, e.g.\n"
    "#   kubectl -n kiln create secret generic kiln-cluster \\\n"
    '#     --from-literal=KILN_CLUSTER_SECRET="$(openssl rand -hex 24)"\n'
    "#   kubectl -n kiln create secret generic kiln-s3 \\\n"
    "#     --from-literal=KILN_S3_ACCESS_KEY_ID=… --from-literal=KILN_S3_SECRET_ACCESS_KEY=…\n"
)


def render() -> dict:
    """File name in deploy/kubernetes → its text."""
    from helm_python import chart

    out = {}
    rendered = chart.Chart.load(str(CHART)).render(VALUES, name=RELEASE, namespace=NAMESPACE)
    for path, text in sorted(rendered.items()):
        name = Path(path).name
        if not name.endswith(".yaml") or not text.strip():
            continue
        head = HEADER + (SECRET_NOTE if name == "secret.yaml" else "")
        out[name] = head + text.strip("\n") + "\n"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail when the files differ; write nothing")
    ap.add_argument("--dir", type=Path, default=OUT, help="the manifests' directory (default: %(default)s)")
    args = ap.parse_args()
    out = args.dir
    want = render()
    have = {p.name: p.read_text() for p in out.glob("*.yaml")}
    differ = sorted(n for n in want if have.get(n) != want[n])
    stale = sorted(set(have) - set(want))
    if args.check:
        for n in differ:
            print(f"{out / n}: differs from the chart's rendering", file=sys.stderr)
        for n in stale:
            print(f"{out / n}: the chart renders no such file", file=sys.stderr)
        if differ or stale:
            print("run scripts/render-manifests.py to write them again", file=sys.stderr)
            return 1
        return 0
    for n in differ:
        (out / n).write_text(want[n])
        print(f"wrote {out / n}")
    for n in stale:
        (out / n).unlink()
        print(f"removed {out / n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
