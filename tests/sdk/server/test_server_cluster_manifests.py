"""The Kubernetes manifests of a kiln cluster (deploy/kubernetes/, docs/cluster.md): every
object validates against the Kubernetes API schemas (strict: no unknown fields) with PyPI's
kubernetes-validate, whose schemas ship in the package (the test refuses every network
connection while it validates); the objects refer to each other consistently (Secret and
ConfigMap keys, Service selectors, etcd members); and the flags and environment variables they
give `kiln node` and `kiln control` are ones the built binary takes.
"""

import glob
import os
import re
import socket
import subprocess

import pytest
import yaml

from .conftest import kiln_bin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MANIFESTS = os.path.join(ROOT, "deploy", "kubernetes")
# Kubernetes versions validated against: the oldest still commonly run and the newest bundled.
VERSIONS = ("1.30.0", None)


def objects() -> list:
    out = []
    for path in sorted(glob.glob(os.path.join(MANIFESTS, "*.yaml"))):
        with open(path) as f:
            out += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return out


def by_kind(kind: str) -> dict:
    return {o["metadata"]["name"]: o for _, o in objects() if o["kind"] == kind}


def containers() -> list:
    """(workload name, container) of every Deployment, DaemonSet and StatefulSet."""
    out = []
    for kind in ("Deployment", "DaemonSet", "StatefulSet"):
        for name, o in by_kind(kind).items():
            out += [(name, c) for c in o["spec"]["template"]["spec"]["containers"]]
    return out


@pytest.fixture
def offline(monkeypatch):
    """Every outgoing connection fails while the test runs."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network connection attempted: {args[1:] or kwargs}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_every_object_validates_against_the_kubernetes_schemas_offline(offline):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    objs = objects()
    kinds = {o["kind"] for _, o in objs}
    assert {"Namespace", "Secret", "ConfigMap", "Service", "StatefulSet", "DaemonSet",
            "Deployment"} <= kinds, kinds
    for version in VERSIONS:
        version = version or latest_version()
        for path, o in objs:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{path}: {o['kind']}/{o['metadata']['name']} (Kubernetes {version}): {e.message}")
    # The validator does catch a mistake (a misspelt field, a wrong type).
    _, deploy = next((p, o) for p, o in objs if o["kind"] == "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(deploy))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)
    bad = yaml.safe_load(yaml.safe_dump(deploy))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)


def test_the_objects_refer_to_each_other():
    objs = objects()
    assert {o["metadata"].get("namespace", "kiln") for _, o in objs} == {"kiln"}
    secrets, maps = by_kind("Secret"), by_kind("ConfigMap")
    for workload, c in containers():
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"], (workload, ref)
        for src in c.get("envFrom", []):
            assert src["configMapRef"]["name"] in maps, (workload, src)
    assert len(secrets["kiln-cluster"]["stringData"]["KILN_CLUSTER_SECRET"]) >= 16
    # Every Service selects the pods of a workload, on a port they open.
    workloads = [o for _, o in objs if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]
    for name, svc in by_kind("Service").items():
        sel = svc["spec"]["selector"]
        pods = [w for w in workloads if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, name
        ports = {p.get("name") for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]} | \
                {p["containerPort"] for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in ports, (name, p)
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    # The etcd members named in the settings are the StatefulSet's pods.
    etcd = by_kind("StatefulSet")["kiln-etcd"]
    members = [f"http://kiln-etcd-{i}.kiln-etcd:2379" for i in range(etcd["spec"]["replicas"])]
    assert maps["kiln-settings"]["data"]["KILN_ETCD"].split(",") == members
    script = etcd["spec"]["template"]["spec"]["containers"][0]["args"][0]
    initial = re.search(r'--initial-cluster "([^"]+)"', script).group(1)
    assert initial == ",".join(f"kiln-etcd-{i}=http://kiln-etcd-{i}.kiln-etcd:2380"
                               for i in range(etcd["spec"]["replicas"]))
    node = by_kind("DaemonSet")["kiln-node"]["spec"]["template"]["spec"]["containers"][0]
    assert node["securityContext"]["privileged"] is True


def test_kiln_takes_the_flags_and_settings_the_manifests_give_it():
    for workload, c in containers():
        if c["image"].split(":")[0] != "kiln":
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
            names |= set(by_kind("ConfigMap")[src["configMapRef"]["name"]]["data"])
        assert {n for n in names if n.startswith("KILN_")} <= known, (workload, names - known)
