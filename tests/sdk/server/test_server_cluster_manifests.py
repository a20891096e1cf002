"""kiln on Kubernetes: the Helm chart deploy/helm/kiln and the plain manifests rendered from it
(deploy/kubernetes/, docs/cluster.md). The chart lints clean with Helm's own Go SDK (PyPI's
helm-python-sdk: no `helm` binary) and refuses bad values saying what to fix; the plain
manifests are exactly its rendering; every object of the plain manifests and of releases with
their own settings validates against the Kubernetes API schemas (strict: no unknown fields)
with PyPI's kubernetes-validate, whose schemas ship in the package (the tests refuse every
network connection while they render and validate); the objects refer to each other
consistently (Secret and ConfigMap keys, Service selectors, etcd members); and the flags and
environment variables they give `kiln node` and `kiln control` are ones the built binary takes.
"""

import glob
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from .conftest import kiln_bin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MANIFESTS = os.path.join(ROOT, "deploy", "kubernetes")
CHART = os.path.join(ROOT, "deploy", "helm", "kiln")
RENDER = os.path.join(ROOT, "scripts", "render-manifests.py")
# Kubernetes versions validated against: the oldest still commonly run and the newest bundled.
VERSIONS = ("1.30.0", None)
SECRET = "0123456789abcdef0123456789abcdef"


def plain_objects() -> list:
    """(file, object) of every object in deploy/kubernetes."""
    out = []
    for path in sorted(glob.glob(os.path.join(MANIFESTS, "*.yaml"))):
        with open(path) as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


def render(values: dict, release: str = "kiln", namespace: str = "kiln") -> list:
    """(template, object) of every object the chart renders with `values`."""
    from helm_python import chart

    rendered = chart.Chart.load(CHART).render(values, name=release, namespace=namespace)
    return [(path, d) for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def by_kind(objs: list, kind: str) -> dict:
    return {o["metadata"]["name"]: o for _, o in objs if o["kind"] == kind}


def workloads(objs: list) -> list:
    return [o for _, o in objs if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]


def containers(objs: list) -> list:
    """(workload name, container) of every Deployment, DaemonSet and StatefulSet."""
    return [(w["metadata"]["name"], c) for w in workloads(objs)
            for c in w["spec"]["template"]["spec"]["containers"]]


def env_of(objs: list, workload: str) -> dict:
    """Name → entry of the first container's environment of `workload`."""
    c = next(c for name, c in containers(objs) if name == workload)
    return {e["name"]: e for e in c.get("env", [])}


@pytest.fixture
def offline(monkeypatch):
    """Every outgoing connection fails while the test runs."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network connection attempted: {args[1:] or kwargs}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def assert_valid(objs: list) -> None:
    """Every object validates against the Kubernetes schemas of each of VERSIONS."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    for version in VERSIONS:
        version = version or latest_version()
        for path, o in objs:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{path}: {o['kind']}/{o['metadata']['name']} (Kubernetes {version}): {e.message}")


def assert_consistent(objs: list, namespace: str, prefix: str, external_secrets=()) -> None:
    """The objects refer to each other: Secret and ConfigMap keys, Service selectors, etcd
    members; `external_secrets` are Secrets the user makes (not among the objects)."""
    assert {o["metadata"].get("namespace", namespace) for _, o in objs} == {namespace}
    secrets, maps = by_kind(objs, "Secret"), by_kind(objs, "ConfigMap")
    for workload, c in containers(objs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["name"] not in external_secrets:
                assert ref.get("optional") or ref["name"] in secrets, (workload, ref)
                if ref["name"] in secrets:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (workload, ref)
        for src in c.get("envFrom", []):
            assert src["configMapRef"]["name"] in maps, (workload, src)
    if f"{prefix}-cluster" in secrets:
        assert len(secrets[f"{prefix}-cluster"]["stringData"]["KILN_CLUSTER_SECRET"]) >= 16
    # Every Service selects the pods of exactly one workload, on a port they open.
    for name, svc in by_kind(objs, "Service").items():
        sel = svc["spec"]["selector"]
        pods = [w for w in workloads(objs) if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, (name, sel)
        opened = [p for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
        ports = {p.get("name") for p in opened} | {p["containerPort"] for p in opened}
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in ports, (name, p)
    for w in workloads(objs):
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    # The etcd members named in the settings are the StatefulSet's pods.
    etcd = by_kind(objs, "StatefulSet").get(f"{prefix}-etcd")
    if etcd:
        name, n = f"{prefix}-etcd", etcd["spec"]["replicas"]
        assert maps[f"{prefix}-settings"]["data"]["KILN_ETCD"].split(",") == \
            [f"http://{name}-{i}.{name}:2379" for i in range(n)]
        script = etcd["spec"]["template"]["spec"]["containers"][0]["args"][0]
        initial = re.search(r'--initial-cluster "([^"]+)"', script).group(1)
        assert initial == ",".join(f"{name}-{i}=http://{name}-{i}.{name}:2380" for i in range(n))
        assert etcd["spec"]["serviceName"] in by_kind(objs, "Service")
    node = by_kind(objs, "DaemonSet")[f"{prefix}-node"]["spec"]["template"]["spec"]["containers"][0]
    assert node["securityContext"]["privileged"] is True


def assert_kiln_takes_them(objs: list) -> None:
    """The flags and KILN_* settings given to kiln containers are ones `kiln <role>` takes."""
    checked = 0
    for workload, c in containers(objs):
        if c["name"] not in ("kiln-node", "kiln-control"):
            continue
        role = c["args"][0]
        assert role in ("node", "control"), (workload, role)
        r = subprocess.run([kiln_bin(), role, "--help"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        flags = set(re.findall(r"(--[a-z0-9-]+)", r.stdout))
        for a in c["args"][1:]:
            if a.startswith("--"):
                assert a in flags, (workload, a)
        known = set(re.findall(r"env: (KILN_[A-Z0-9_]+)", r.stdout)) | {"KILN_LOG"}
        # Settings read from the environment only (secrets never go on the command line).
        for pair in re.findall(r"environment only:\s+(KILN_[A-Z0-9_]+)\s+and\s+(KILN_[A-Z0-9_]+)", r.stdout):
            known |= set(pair)
        names = {e["name"] for e in c.get("env", [])}
        for src in c.get("envFrom", []):
            names |= set(by_kind(objs, "ConfigMap")[src["configMapRef"]["name"]]["data"])
        assert {n for n in names if n.startswith("KILN_")} <= known, (workload, names - known)
        checked += 1
    assert checked == 2, "one kiln node and one kiln control workload"


def test_the_plain_manifests_validate_against_the_kubernetes_schemas_offline(offline):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    objs = plain_objects()
    assert {"Namespace", "Secret", "ConfigMap", "Service", "StatefulSet", "DaemonSet",
            "Deployment"} <= {o["kind"] for _, o in objs}
    assert_valid(objs)
    # The validator does catch a mistake (a misspelt field, a wrong type).
    deploy = next(o for _, o in objs if o["kind"] == "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(deploy))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)
    bad = yaml.safe_load(yaml.safe_dump(deploy))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)


def test_the_plain_manifests_refer_to_each_other_and_kiln_takes_their_settings():
    objs = plain_objects()
    assert_consistent(objs, "kiln", "kiln")
    assert_kiln_takes_them(objs)


def test_the_plain_manifests_are_the_chart_rendered(tmp_path):
    r = subprocess.run([sys.executable, RENDER, "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # The check does see a difference, a missing file and a file the chart does not make.
    for name in os.listdir(MANIFESTS):
        shutil.copy(os.path.join(MANIFESTS, name), tmp_path / name)
    with open(tmp_path / "control.yaml", "a") as f:
        f.write("# edited by hand\n")
    os.remove(tmp_path / "etcd.yaml")
    (tmp_path / "extra.yaml").write_text("kind: ConfigMap\n")
    r = subprocess.run([sys.executable, RENDER, "--check", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    for name in ("control.yaml", "etcd.yaml", "extra.yaml"):
        assert name in r.stderr, r.stderr
    # Writing makes them equal again.
    r = subprocess.run([sys.executable, RENDER, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(MANIFESTS))
    for name in os.listdir(MANIFESTS):
        assert (tmp_path / name).read_text() == open(os.path.join(MANIFESTS, name)).read(), name


def test_the_chart_lints_clean(offline):
    from helm_python import chart

    for values in ({"clusterSecret": {"value": SECRET}},
                   {"clusterSecret": {"existingSecret": "mine"}, "etcd": {"enabled": False,
                    "external": ["http://etcd.example.internal:2379"]}}):
        report = chart.lint(CHART, values, strict=True)
        assert report["total_charts_linted"] == 1, report
        assert not report["errors"], report
        # Severity 1 is information ("icon is recommended"); warnings and errors fail.
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_a_release_with_its_own_settings(offline):
    values = {
        "image": {"repository": "registry.example.internal/kiln", "tag": "1.2.3", "pullPolicy": "Always"},
        "clusterSecret": {"existingSecret": "sbx-secret"},
        "etcd": {"replicas": 5, "storage": "10Gi", "storageClassName": "fast", "prefix": "/sbx"},
        "domain": "sandboxes.example.internal",
        "logLevel": "debug",
        "s3": {"endpoint": "http://objects.example.internal:9000", "bucket": "checkpoints",
               "existingSecret": "sbx-s3"},
        # A nodeSelector adds to the chart's (kiln.dev/node=true); null drops a key of it.
        "node": {"nodeSelector": {"pool": "sandboxes", "kiln.dev/node": None}, "port": 4100, "stateHostPath": "/srv/kiln",
                 "tolerations": [{"key": "sandboxes", "operator": "Exists", "effect": "NoSchedule"}],
                 "restartGraceSeconds": 300, "templateBuilds": True,
                 "extraArgs": ["--max-sandboxes", "200"]},
        "control": {"replicas": 4, "port": 3100, "service": {"type": "LoadBalancer", "port": 443},
                    "extraArgs": ["--team-max-sandboxes", "50"]},
    }
    objs = render(values, release="sbx", namespace="agents")
    assert_valid(objs)
    assert_consistent(objs, "agents", "sbx", external_secrets=("sbx-secret", "sbx-s3"))
    assert_kiln_takes_them(objs)
    assert "Namespace" not in {o["kind"] for _, o in objs}
    assert by_kind(objs, "Secret") == {}, "the user's own Secrets are named, not made"
    etcd = by_kind(objs, "StatefulSet")["sbx-etcd"]
    assert etcd["spec"]["replicas"] == 5
    claim = etcd["spec"]["volumeClaimTemplates"][0]["spec"]
    assert (claim["storageClassName"], claim["resources"]["requests"]["storage"]) == ("fast", "10Gi")
    settings = by_kind(objs, "ConfigMap")["sbx-settings"]["data"]
    assert settings["KILN_ETCD_PREFIX"] == "/sbx" and settings["KILN_DOMAIN"] == "sandboxes.example.internal"
    assert settings["KILN_LOG"] == "debug"
    node_ds = by_kind(objs, "DaemonSet")["sbx-node"]
    pod = node_ds["spec"]["template"]["spec"]
    node = pod["containers"][0]
    assert node["image"] == "registry.example.internal/kiln:1.2.3" and node["imagePullPolicy"] == "Always"
    assert node["args"] == ["node", "--listen", "0.0.0.0:4100", "--state-dir", "/var/lib/kiln/state",
                            "--restart-grace", "300", "--template-builds", "--max-sandboxes", "200"]
    assert pod["nodeSelector"] == {"pool": "sandboxes"} and pod["tolerations"][0]["key"] == "sandboxes"
    assert pod["volumes"][0]["hostPath"]["path"] == "/srv/kiln"
    env = env_of(objs, "sbx-node")
    assert env["KILN_NODE_ADVERTISE"]["value"] == "$(POD_IP):4100"
    assert env["KILN_S3_ENDPOINT"]["value"] == "http://objects.example.internal:9000"
    assert env["KILN_S3_BUCKET"]["value"] == "checkpoints"
    assert env["KILN_S3_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "sbx-s3"
    assert env["KILN_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "sbx-secret"
    assert env_of(objs, "sbx-control")["KILN_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "sbx-secret"
    control = by_kind(objs, "Deployment")["sbx-control"]
    assert control["spec"]["replicas"] == 4
    assert control["spec"]["template"]["spec"]["containers"][0]["args"] == \
        ["control", "--listen", "0.0.0.0:3100", "--team-max-sandboxes", "50"]
    svc = by_kind(objs, "Service")["sbx-control"]["spec"]
    assert svc["type"] == "LoadBalancer" and svc["ports"][0]["port"] == 443


def test_an_external_etcd_and_the_charts_own_secrets(offline):
    urls = ["https://etcd-a.example.internal:2379", "https://etcd-b.example.internal:2379"]
    objs = render({"clusterSecret": {"value": SECRET}, "etcd": {"enabled": False, "external": urls},
                   "s3": {"endpoint": "https://objects.example.internal", "accessKeyId": "AKID",
                          "secretAccessKey": "s3cret"}})
    assert_valid(objs)
    assert_consistent(objs, "kiln", "kiln")
    assert "StatefulSet" not in {o["kind"] for _, o in objs}
    assert "kiln-etcd" not in by_kind(objs, "Service")
    assert by_kind(objs, "ConfigMap")["kiln-settings"]["data"]["KILN_ETCD"] == ",".join(urls)
    secrets = by_kind(objs, "Secret")
    assert secrets["kiln-cluster"]["stringData"] == {"KILN_CLUSTER_SECRET": SECRET}
    assert secrets["kiln-s3"]["stringData"] == {"KILN_S3_ACCESS_KEY_ID": "AKID",
                                                "KILN_S3_SECRET_ACCESS_KEY": "s3cret"}


def test_two_releases_in_one_namespace_keep_apart(offline):
    a = render({"clusterSecret": {"value": SECRET}}, release="kiln-a", namespace="shared")
    b = render({"clusterSecret": {"value": SECRET}}, release="kiln-b", namespace="shared")
    names = lambda objs: {(o["kind"], o["metadata"]["name"]) for _, o in objs}  # noqa: E731
    assert not names(a) & names(b)
    # No Service or workload selector of one release matches the pods of the other.
    for mine, theirs in ((a, b), (b, a)):
        for _, o in mine:
            sel = o["spec"]["selector"] if o["kind"] == "Service" else \
                o["spec"]["selector"]["matchLabels"] if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet") else None
            if sel is None:
                continue
            for w in workloads(theirs):
                assert not sel.items() <= w["spec"]["template"]["metadata"]["labels"].items(), (o["metadata"], w["metadata"])


@pytest.mark.parametrize("values, says", [
    ({}, "clusterSecret: name an existingSecret or give a value"),
    ({"clusterSecret": {"value": "short"}}, "at least 16 characters"),
    ({"clusterSecret": {"value": SECRET}, "etcd": {"enabled": False}}, "etcd.external: give the client URLs"),
    ({"clusterSecret": {"value": SECRET}, "control": {"replicas": "two"}}, "/control/replicas"),
    ({"clusterSecret": {"value": SECRET}, "etcd": {"replica": 3}}, "'replica' not allowed"),
    ({"clusterSecret": {"value": SECRET}, "s3": {"endpoint": "objects:9000"}}, "/s3/endpoint"),
    ({"clusterSecret": {"value": SECRET}, "s3": {"accessKeyId": "AKID"}}, "s3.secretAccessKey: give both"),
    ({"clusterSecret": {"value": SECRET}, "node": {"port": 70000}}, "/node/port"),
    ({"clusterSecret": {"value": SECRET}, "node": {"restartGraceSeconds": -1}}, "/node/restartGraceSeconds"),
])
def test_bad_values_are_refused_saying_what_to_fix(offline, values, says):
    from helm_python import chart

    with pytest.raises(Exception) as e:
        chart.Chart.load(CHART).render(values, name="kiln", namespace="kiln")
    assert says in str(e.value), str(e.value)
