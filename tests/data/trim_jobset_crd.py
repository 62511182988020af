"""Make tests/data/jobset-crd-v0.12.0.yaml from the upstream JobSet CRD (823 KB, most of it the
embedded Pod spec and its descriptions):

    git -C jobset show v0.12.0:config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml \
        | python tests/data/trim_jobset_crd.py v0.12.0 "$(git -C jobset rev-parse 'v0.12.0^{commit}')" \
        > tests/data/jobset-crd-v0.12.0.yaml

Kept: the v1alpha2 openAPIV3Schema, every JobSet and Job field as upstream has it (failurePolicy,
replicatedJobs, the Job's podFailurePolicy...), and the Pod spec fields the manifests use. Dropped:
every `description`. Cut to a stub (its type and `x-kubernetes-preserve-unknown-fields: true`, so
the name is still known but its inside is not checked): the Pod spec fields listed in STUBS below
and every volume source but those in VOLUME_SOURCES_KEPT.
"""

from __future__ import annotations

import sys

import yaml

SOURCE = "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
POD_SPEC = ("spec", "replicatedJobs", "[]", "template", "spec", "template", "spec")
STUBS = {
    POD_SPEC: ("affinity", "ephemeralContainers", "initContainers", "topologySpreadConstraints"),
    POD_SPEC + ("containers", "[]"): ("lifecycle", "livenessProbe", "readinessProbe", "startupProbe"),
}
VOLUME_SOURCES_KEPT = {"name", "csi", "emptyDir", "persistentVolumeClaim", "configMap", "secret"}


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def at(schema: dict, path: tuple[str, ...]) -> dict:
    for part in path:
        schema = schema["items"] if part == "[]" else schema["properties"][part]
    return schema


def stub(schema: dict) -> dict:
    return {"type": schema.get("type", "object"), "x-kubernetes-preserve-unknown-fields": True}


def trim(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = without_descriptions(version["schema"]["openAPIV3Schema"])
    for path, names in STUBS.items():
        properties = at(schema, path)["properties"]
        for name in names:
            properties[name] = stub(properties[name])
    volume = at(schema, POD_SPEC + ("volumes", "[]"))["properties"]
    for name in set(volume) - VOLUME_SOURCES_KEPT:
        volume[name] = stub(volume[name])
    return schema


def main() -> None:
    tag, commit = sys.argv[1:3]
    crd = yaml.safe_load(sys.stdin)
    sys.stdout.write(f"# The openAPIV3Schema of JobSet v1alpha2 from kubernetes-sigs/jobset {tag}, {SOURCE}\n"
                     f"# (commit {commit},"
                     f" controller-gen {crd['metadata']['annotations']['controller-gen.kubebuilder.io/version']}),"
                     " trimmed by tests/data/trim_jobset_crd.py: no descriptions, unused Pod spec fields\n"
                     "# cut to stubs. Upstream data, kept for validating deploy/k8s/*.yaml (tests/test_k8s.py).\n")
    yaml.safe_dump({"version": tag, "commit": commit, "source": SOURCE, "openAPIV3Schema": trim(crd)}, sys.stdout,
                   sort_keys=True, default_flow_style=None, width=120)


if __name__ == "__main__":
    main()
