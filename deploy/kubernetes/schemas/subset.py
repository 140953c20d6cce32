"""Regenerates the vendored Kubernetes JSON schemas: the resource schemas the manifests here use, and
only the part of `_definitions.json` they reach (plus PodTemplateSpec, for the MPIJob schema).

The source is the `kubernetes-validate` wheel from PyPI (Apache-2.0), which ships the Kubernetes
OpenAPI definitions converted to JSON Schema (draft 2020-12), in a "strict" flavour that rejects
unknown fields as `kubectl apply --validate=strict` does:

    pip download --no-deps kubernetes-validate==1.37.0 -d /tmp/kv
    python deploy/kubernetes/schemas/subset.py /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl

Not run by the tests (they must work offline); the output is committed.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

VERSION = "v1.33.0-local-strict"
OUT = Path(__file__).resolve().parent / "kubernetes-v1.33-strict"
# The resource schemas the manifests in deploy/kubernetes use (file names as in the wheel).
RESOURCES = ["configmap-v1.json", "networkpolicy-networking-v1.json"]
# Definitions the MPIJob schema refers to directly.
EXTRA_ROOTS = ["io.k8s.api.core.v1.PodTemplateSpec"]
DEFS = "_definitions.json"


def refs(node: object) -> set[str]:
    """The definition names every `$ref` under node points to."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and "#/$defs/" in value:
                found.add(value.split("#/$defs/", 1)[1])
            else:
                found |= refs(value)
    elif isinstance(node, list):
        for item in node:
            found |= refs(item)
    return found


def main(wheel: str) -> None:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{VERSION}/"
    with zipfile.ZipFile(wheel) as z:
        defs = json.loads(z.read(prefix + DEFS))
        resources = {name: json.loads(z.read(prefix + name)) for name in RESOURCES}
    todo = set(EXTRA_ROOTS)
    for schema in resources.values():
        todo |= refs(schema)
    keep: dict[str, object] = {}
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = defs["$defs"][name]
            todo |= refs(keep[name]) - keep.keys()
    OUT.mkdir(exist_ok=True)
    subset = {"$schema": defs["$schema"], "$id": defs["$id"], "$defs": dict(sorted(keep.items()))}
    (OUT / DEFS).write_text(json.dumps(subset, indent=1, sort_keys=False) + "\n")
    for name, schema in resources.items():
        (OUT / name).write_text(json.dumps(schema, indent=1) + "\n")
    print(f"{len(keep)} of {len(defs['$defs'])} definitions kept in {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
