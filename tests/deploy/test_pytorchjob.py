"""deploy/kubernetes/pytorchjob: the Kubeflow PyTorchJob (torchrun, no mpirun) validates offline against a
vendored schema that catches mistakes, its parts agree, and its pods' command runs for real here with
the environment the Training Operator gives each pod."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest

from smddp.transport.netif import service_port
from tests.conftest import communicate_all
from tests.deploy.helpers import BIN, DEPLOY, REPO, base_env
from tests.deploy.test_kubernetes import SCHEMAS, STRICT, documents, registry
from tests.replicas import assert_replicas_identical

pytestmark = pytest.mark.deploy

HERE = DEPLOY / "kubernetes" / "pytorchjob"
SCHEMA_FOR = {
    ("kubeflow.org/v1", "PyTorchJob"): SCHEMAS / "pytorchjob-kubeflow-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): STRICT / "networkpolicy-networking-v1.json",
}


def errors(doc: dict) -> list[str]:
    import json

    from jsonschema import Draft202012Validator

    path = SCHEMA_FOR.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    assert path, f"no vendored schema for {doc.get('apiVersion')} {doc.get('kind')}"
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    v = Draft202012Validator(schema, registry=registry())
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]


def job() -> dict:
    (doc,) = documents(HERE / "pytorchjob.yaml")
    return copy.deepcopy(doc)


def containers(j: dict) -> dict[str, dict]:
    return {
        role: spec["template"]["spec"]["containers"][0]
        for role, spec in j["spec"]["pytorchReplicaSpecs"].items()
    }


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "networkpolicy.yaml"])
def test_manifest_validates(name: str) -> None:
    for doc in documents(HERE / name):
        found = errors(doc)
        assert not found, f"{name}: " + "\n".join(found)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda j: j["spec"].update(nprocPerNodes="8"), "nprocPerNodes"),  # a typo
        (lambda j: j["spec"].update(nprocPerNode=8), "is not of type 'string'"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2), "1 was expected"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"].update(Launcher={}), "Launcher"),
        (lambda j: j["spec"].pop("pytorchReplicaSpecs"), "pytorchReplicaSpecs"),
        (lambda j: containers(j)["Worker"].update(agrs=[]), "agrs"),
        (lambda j: j["metadata"].update(name="smddp.torchrun"), "smddp.torchrun"),
    ],
)
def test_the_pytorchjob_schema_catches_mistakes(mutate, expected) -> None:  # type: ignore[no-untyped-def]
    j = job()
    mutate(j)
    found = errors(j)
    assert found and any(expected in e for e in found), found


def test_the_parts_agree() -> None:
    j = job()
    specs = j["spec"]["pytorchReplicaSpecs"]
    for role, c in containers(j).items():
        # The operator finds the training container by name; torchrun reads its flags from PET_*.
        assert c["name"] == "pytorch", role
        assert c["args"][0] == "torchrun" and "--nproc-per-node" not in c["args"], role
        # One worker per GPU.
        assert c["resources"]["limits"]["nvidia.com/gpu"] == int(j["spec"]["nprocPerNode"]), role
        # The secret comes from a file only its owner can read, mounted where SMDDP_SECRET_FILE says.
        env = {e["name"]: e["value"] for e in c["env"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in specs[role]["template"]["spec"]["volumes"]}
        secret = volumes["smddp-secret"]["secret"]
        assert secret["defaultMode"] & 0o077 == 0, role
        assert mounts["smddp-secret"]["readOnly"] is True
        assert env["SMDDP_SECRET_FILE"] == mounts["smddp-secret"]["mountPath"] + "/secret", role
        # The pods are the job's; the network policy lets exactly them reach each other.
        labels = specs[role]["template"]["metadata"]["labels"]
        (policy,) = documents(HERE / "networkpolicy.yaml")
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert containers(j)["Master"]["args"] == containers(j)["Worker"]["args"]


def test_no_secret_in_the_manifests() -> None:
    text = "\n".join(p.read_text() for p in HERE.glob("*.yaml"))
    assert "kind: Secret" not in text and "PRIVATE KEY" not in text
    for c in containers(job()).values():
        assert all("SECRET" not in e["name"] or e["name"] == "SMDDP_SECRET_FILE" for e in c["env"])


def test_the_pods_command_runs_under_the_operators_environment(tmp_path: Path) -> None:
    """Each pod as the Training Operator starts it: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT
    (read by torchrun as its flags), the container's env and args, the secret file with the mounted
    mode. Here both "pods" run on this host with one worker each (PET_NPROC_PER_NODE=1) on loopback."""
    j = job()
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    mode = j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"][0]["secret"][
        "defaultMode"
    ]
    secret.chmod(mode)
    port = service_port()
    procs = []
    for rank, role in enumerate(["Master", "Worker"]):
        c = containers(j)[role]
        env = base_env(**{e["name"]: e["value"] for e in c["env"]})
        env.update(
            PET_NNODES="2",
            PET_NODE_RANK=str(rank),
            PET_NPROC_PER_NODE="1",
            PET_MASTER_ADDR="127.0.0.1",
            PET_MASTER_PORT=str(port),
            SMDDP_SECRET_FILE=str(secret),
            SMDDP_IFACE="",  # both "pods" on this host: loopback
            PET_LOG_DIR=str(tmp_path / f"torchelastic{rank}"),  # (a pod's /tmp is its own; here, the host's)
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )
        args = [a.replace("/opt/smddp/", f"{REPO}/") for a in c["args"]]
        argv = [str(BIN / args[0]), *args[1:], "--epochs", "2", "--save-params", str(tmp_path)]
        procs.append(
            subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = communicate_all(procs, 300)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    assert "training" in outs[0][0] and "on 2 workers" in outs[0][0], outs[0][0]
    assert "replicas agree bit for bit: True" in outs[0][0]
    assert_replicas_identical(tmp_path, 2)
