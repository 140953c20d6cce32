"""deploy/kubernetes: every manifest parses and validates offline against vendored schemas (Kubernetes
v1.33 strict for the core kinds, a hand-written MPIJob v2beta1 schema), the schemas catch mistakes,
the manifests agree with each other, and the launcher pod's command gives the expected mpirun."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from tests.deploy.helpers import BIN, DEPLOY, base_env, parse_mpirun, run

pytestmark = pytest.mark.deploy

K8S = DEPLOY / "kubernetes"
SCHEMAS = K8S / "schemas"
STRICT = SCHEMAS / "kubernetes-v1.33-strict"
# (apiVersion, kind) -> the schema file that validates it.
SCHEMA_FOR = {
    ("v1", "ConfigMap"): STRICT / "configmap-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): STRICT / "networkpolicy-networking-v1.json",
    ("kubeflow.org/v2beta1", "MPIJob"): SCHEMAS / "mpijob-kubeflow-v2beta1.json",
}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml"))


@cache
def registry() -> Registry:
    """Every vendored schema under its own $id: references resolve offline, never over the network."""
    resources = []
    for path in sorted(SCHEMAS.rglob("*.json")):
        contents = json.loads(path.read_text())
        resources.append((contents["$id"], Resource.from_contents(contents)))
    return Registry().with_resources(resources)


def validator(api_version: str, kind: str) -> Draft202012Validator:
    path = SCHEMA_FOR.get((api_version, kind))
    assert path, f"no vendored schema for {api_version} {kind}: add one under {SCHEMAS}"
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, registry=registry())


def errors(doc: dict) -> list[str]:
    v = validator(doc.get("apiVersion", ""), doc.get("kind", ""))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]


def documents(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} has no document"
    return docs


@cache
def by_kind() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in MANIFESTS:
        for doc in documents(path):
            out.setdefault(doc["kind"], []).append(doc)
    return out


def mpijob() -> dict:
    (job,) = by_kind()["MPIJob"]
    return copy.deepcopy(job)


def test_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"mpijob.yaml", "configmap.yaml", "networkpolicy.yaml", "networkpolicy-egress.yaml"} <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path: Path):
    for doc in documents(path):
        assert not errors(doc), f"{path.name}: {doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(
            errors(doc)
        )


def test_every_reference_in_the_vendored_schemas_resolves():
    """The Kubernetes subset is closed: no $ref points at a definition that was left out."""
    reg = registry()

    def refs(node, base):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    yield base, value
                else:
                    yield from refs(value, base)
        elif isinstance(node, list):
            for item in node:
                yield from refs(item, base)

    count = 0
    for path in SCHEMAS.rglob("*.json"):
        contents = json.loads(path.read_text())
        resolver = reg.resolver(base_uri=contents["$id"])
        for _base, ref in refs(contents, contents["$id"]):
            resolver.lookup(ref)  # raises if missing
            count += 1
    assert count > 100


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda j: j["spec"].update(slotPerWorker=8), "slotPerWorker"),  # a typo
        (lambda j: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(replicas=2), "1 was expected"),
        (
            lambda j: j["spec"]["mpiReplicaSpecs"].update(Master=j["spec"]["mpiReplicaSpecs"]["Worker"]),
            "Master",
        ),
        (lambda j: j["spec"].update(mpiImplementation="MVAPICH"), "MVAPICH"),
        (lambda j: j["metadata"].update(name="smddp.train"), "smddp.train"),
        (lambda j: j["spec"].pop("mpiReplicaSpecs"), "mpiReplicaSpecs"),
        # Inside the pod template: the Kubernetes schema applies.
        (lambda j: worker_container(j).update(imagePullPolcy="Always"), "imagePullPolcy"),
        (lambda j: worker_container(j)["ports"][0].update(containerPort="ssh"), "containerPort"),
        (lambda j: worker_container(j)["resources"].update(limit={}), "limit"),
        (lambda j: worker_pod(j).pop("containers"), "containers"),
    ],
)
def test_the_mpijob_schema_catches_mistakes(mutate, expected):
    job = mpijob()
    mutate(job)
    found = errors(job)
    assert found and any(expected in e for e in found), found


def test_the_kubernetes_schemas_catch_mistakes():
    (cm,) = by_kind()["ConfigMap"]
    bad = copy.deepcopy(cm)
    bad["data"]["SMDDP_SSH_PORT"] = 22  # ConfigMap values are strings
    assert errors(bad)
    (policy,) = copy.deepcopy([p for p in by_kind()["NetworkPolicy"] if "ingress" in p["spec"]])
    policy["spec"]["ingress"][0]["ports"][0]["protocl"] = "TCP"
    assert any("protocl" in e for e in errors(policy))


def worker_pod(job: dict) -> dict:
    return job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]


def worker_container(job: dict) -> dict:
    return worker_pod(job)["containers"][0]


def launcher_container(job: dict) -> dict:
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


def settings() -> dict[str, str]:
    (cm,) = by_kind()["ConfigMap"]
    return cm["data"]


def test_the_manifests_agree():
    job = mpijob()
    (cm,) = by_kind()["ConfigMap"]
    worker, launcher = worker_container(job), launcher_container(job)
    # Both pods read the settings ConfigMap that is shipped.
    for c in (worker, launcher):
        assert {"configMapRef": {"name": cm["metadata"]["name"]}} in c["envFrom"]
    # One smddp worker per GPU: slots per worker pod = the GPUs it asks for.
    gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
    assert job["spec"]["slotsPerWorker"] == gpus == worker["resources"]["requests"]["nvidia.com/gpu"]
    assert "nvidia.com/gpu" not in launcher["resources"].get("limits", {})
    # Workers run sshd on the port the launcher waits for; the launcher runs smddp-launch.
    assert worker["args"] == ["sshd"]
    assert worker["ports"] == [{"name": "ssh", "containerPort": 22, "protocol": "TCP"}]
    assert settings()["SMDDP_SSH_PORT"] == "22"
    assert launcher["args"][:2] == ["launch", "--"]
    # The operator mounts the job's keys with mode 0600 only at /root/.ssh.
    assert job["spec"]["sshAuthMountPath"] == "/root/.ssh"
    # Every network policy selects exactly the pods of this job, and allows them every TCP port.
    for policy in by_kind()["NetworkPolicy"]:
        selector = policy["spec"]["podSelector"]["matchLabels"]
        for role in ("Launcher", "Worker"):
            labels = job["spec"]["mpiReplicaSpecs"][role]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), (policy["metadata"]["name"], role)
        rules = policy["spec"].get("ingress", []) + policy["spec"].get("egress", [])
        peers = [
            r for r in rules if {"podSelector": {"matchLabels": selector}} in r.get("from", r.get("to", []))
        ]
        assert peers and all(r["ports"] == [{"protocol": "TCP"}] for r in peers)


def test_no_secret_in_the_manifests():
    """Settings only: no Secret object, no inline env values, nothing that looks like a key."""
    assert "Secret" not in by_kind()
    job = mpijob()
    for c in (worker_container(job), launcher_container(job)):
        assert "env" not in c, "settings belong in the ConfigMap"
    text = "\n".join(p.read_text() for p in MANIFESTS)
    assert "PRIVATE KEY" not in text
    for key in settings():
        assert not any(w in key.upper() for w in ("SECRET", "TOKEN", "PASSWORD", "KEY")), key


def test_the_launcher_pod_runs_the_expected_mpirun(tmp_path):
    """The hostfile the MPI Operator writes for this MPIJob, the ConfigMap's settings and the launcher's
    args, through the image's entrypoint, give one daemon and G workers on every worker pod."""
    job = mpijob()
    name, slots = job["metadata"]["name"], job["spec"]["slotsPerWorker"]
    replicas = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    hosts = [f"{name}-worker-{i}.{name}.team-a.svc" for i in range(replicas)]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
    env = base_env(**settings())
    env.update(
        SMDDP_HOSTFILE=str(hostfile),
        SMDDP_WAIT_FOR_HOSTS_S="0",  # no sshd to wait for here
        SMDDP_SSH_DIR=str(tmp_path / "ssh"),
        SMDDP_LAUNCH=str(BIN / "smddp-launch"),
    )
    args = launcher_container(job)["args"]
    launch_args, command = args[: args.index("--")], args[args.index("--") + 1 :]
    out = run([str(DEPLOY / "docker/entrypoint.sh"), *launch_args, "--dry-run", "--", *command], env)
    assert out.returncode == 0, out.stderr
    cmd = parse_mpirun(out.stdout)
    assert cmd.daemons.np == replicas
    assert cmd.daemons.hosts == ",".join(f"{h}:1" for h in hosts)
    assert any(a.endswith("smddp-daemon") for a in cmd.daemons.argv)
    iface = settings()["SMDDP_IFACE"]
    assert cmd.daemons.argv[cmd.daemons.argv.index("--iface") + 1] == iface
    assert cmd.prtemca("oob_tcp_if_include") == iface
    assert cmd.workers.np == replicas * slots
    assert cmd.workers.hosts == ",".join(f"{h}:{slots}" for h in hosts)
    assert cmd.workers.argv[-len(command) :] == command
