"""The Kubernetes manifests (`k8s/`), checked without a cluster: every kustomization renders
and validates strictly, meets every policy (`tests/helpers/k8s_manifests.py`), and each policy fails on
a broken copy of the manifests, so none of them can pass vacuously.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.k8s_manifests import (
    K8S,
    KUSTOMIZATIONS,
    LWS_API,
    POLICIES,
    REPO,
    env_of,
    env_source,
    find,
    pool_pods,
    render,
    router_pod,
    schema_problems,
)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(kustomization):
    docs = render(kustomization)
    assert docs, f"k8s/{kustomization} rendered nothing"
    assert schema_problems(docs) == []


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_policy(kustomization, policy):
    assert POLICIES[policy](render(kustomization), kustomization) == []


def test_run_config_is_digits_on_cuda():
    from dyad import config as config_lib

    (config_map,) = [d for d in render("base") if d["kind"] == "ConfigMap"]
    shipped = config_lib.load_yaml_text(config_map["data"]["run.yaml"])
    digits = config_lib.load_yaml_text((REPO / "dyad" / "configs" / "digits.yaml").read_text())
    assert shipped["train"].pop("device") == "cuda"
    assert shipped == digits
    assert config_lib.from_yaml(config_map["data"]["run.yaml"]).train.device == "cuda"


def test_dev_overlay():
    docs = render("overlays/dev")
    namespaced = [d for d in docs if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"dyad-dev"}
    namespace = find(docs, "Namespace", "dyad-dev")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for pool, specs in pool_pods(docs).items():
        assert specs[0]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1, pool
    import base64

    for name in ("dyad-client-token", "dyad-join-token"):
        token = base64.b64decode(find(docs, "Secret", name)["data"]["token"]).decode()
        assert token.startswith("dev-only-not-a-secret"), name
    # the base leaves the Secrets to the operator: no real values in git
    assert not [d for d in render("base") if d["kind"] == "Secret"]


def test_rdma_overlay():
    docs = render("overlays/rdma")
    base = {pool: specs[0]["containers"][0] for pool, specs in pool_pods(render("base")).items()}
    for pool, specs in pool_pods(docs).items():
        (container,) = specs[0]["containers"]
        assert container["image"].endswith("-rdma"), container["image"]
        resources = container["resources"]
        assert resources["limits"]["rdma/rdma_shared_device_a"] == 1
        assert resources["requests"]["rdma/rdma_shared_device_a"] == 1
        capabilities = container["securityContext"]["capabilities"]
        assert capabilities == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        env = {name: e.get("value") for name, e in env_of(container).items()}
        assert "rc" in env["UCX_TLS"].split(",") and "cuda_copy" in env["UCX_TLS"].split(",")
        assert env["UCX_NET_DEVICES"] and env["UCX_IB_GPU_DIRECT_RDMA"] == "yes"
        # nothing else of the base's pod changed
        assert env_of(base[pool]).items() <= env_of(container).items()
    assert router_pod(docs)["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_lws_overlay():
    docs = render("overlays/lws")
    assert find(docs, "StatefulSet", "dyad-llm") is None
    assert find(docs, "Service", "dyad-llm") is None  # the LWS controller creates it
    lws = find(docs, "LeaderWorkerSet", "dyad-llm")
    assert lws["apiVersion"] == LWS_API
    assert lws["spec"]["leaderWorkerTemplate"]["size"] >= 2
    assert lws["spec"]["networkConfig"]["subdomainPolicy"] == "Shared"
    (container,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    assert container["image"] == find(docs, "Deployment", "dyad-router")["spec"]["template"][
        "spec"]["containers"][0]["image"]
    group_index = env_source(container, "DYAD_LWS_GROUP_INDEX")["fieldRef"]["fieldPath"]
    assert group_index == "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"


def _overlay(directory, patches: str) -> str:
    """A kustomization in `directory` on k8s/base with `patches` (YAML); its path."""
    directory.mkdir()
    base = os.path.relpath(K8S / "base", directory)
    (directory / "kustomization.yaml").write_text(f"resources:\n  - {base}\n{patches}")
    return str(directory)


def test_node_pool_labels_overridden_in_an_overlay(tmp_path):
    """The example of docs/deploy.md ("Your own overlay"), as written there: the pools on a
    cluster's own node-pool labels render, validate and stay on disjoint node pools."""
    section = (REPO / "docs" / "deploy.md").read_text().split("## Your own overlay", 1)[1]
    patches = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert patches.startswith("patches:")

    docs = render(_overlay(tmp_path / "own", patches))
    assert schema_problems(docs) == []
    assert POLICIES["node pools"](docs, "own") == []
    assert {pool: [s["nodeSelector"] for s in specs] for pool, specs in pool_pods(docs).items()} == {
        "encoder": [{"cloud.google.com/gke-nodepool": "a100-encoder"}],
        "llm": [{"cloud.google.com/gke-nodepool": "h100-llm"}],
    }
    one_pool = render(_overlay(tmp_path / "one", patches.replace("h100-llm", "a100-encoder")))
    assert POLICIES["node pools"](one_pool, "one") == [
        "node selectors overlap: encoder {'cloud.google.com/gke-nodepool': 'a100-encoder'}, "
        "llm {'cloud.google.com/gke-nodepool': 'a100-encoder'}"
    ]


# ----------------------------------------------------------------------------- the checks can fail


def _pool_container(docs, pool):
    return pool_pods(docs)[pool][0]["containers"][0]


def _break_privileged(docs):
    _pool_container(docs, "llm")["securityContext"]["privileged"] = True


def _break_wildcard(docs):
    find(docs, "Role", "dyad-router")["rules"].append(
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["*"]})


def _break_pod_delete(docs):  # what the router once used for hung workers
    rules = find(docs, "Role", "dyad-router")["rules"]
    next(r for r in rules if r["resources"] == ["pods"])["verbs"].append("delete")


def _break_client_token(docs):
    spec = pool_pods(docs)["encoder"][0]
    spec["volumes"].append({"name": "t", "secret": {"secretName": "dyad-client-token"}})


def _break_node_pools(docs):
    selector = pool_pods(docs)["encoder"][0]["nodeSelector"]
    selector.update(pool_pods(docs)["llm"][0]["nodeSelector"])


def _break_probe(docs):
    del _pool_container(docs, "encoder")["livenessProbe"]


def _break_shm(docs):
    spec = pool_pods(docs)["llm"][0]
    next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"].pop("medium")


def _break_gpus(docs):
    _pool_container(docs, "llm")["resources"]["limits"]["nvidia.com/gpu"] = 4


def _break_router_gpus_per_pod(docs):  # the pool changed, the router's count did not
    for spec in pool_pods(docs)["encoder"]:
        container = spec["containers"][0]
        env_of(container)["DYAD_GPUS_PER_POD"]["value"] = "2"
        for key in ("requests", "limits"):
            container["resources"][key]["nvidia.com/gpu"] = 2


def _break_replicas(docs):
    find(docs, "StatefulSet", "dyad-encoder")["spec"]["replicas"] = 2


def _break_schema(docs):
    find(docs, "Deployment", "dyad-router")["spec"]["template"]["spec"]["containers"][0][
        "readinessProbe"]["grpc"]["port"] = "grpc"  # gRPC probes take a number only


@pytest.mark.parametrize("policy, breaker", [
    ("privilege", _break_privileged),
    ("rbac", _break_wildcard),
    ("rbac", _break_pod_delete),
    ("tokens", _break_client_token),
    ("node pools", _break_node_pools),
    ("probes", _break_probe),
    ("/dev/shm", _break_shm),
    ("resources", _break_gpus),
    ("resources", _break_router_gpus_per_pod),
    ("contract", _break_replicas),
])
def test_policy_catches_a_broken_manifest(policy, breaker):
    docs = render("base")
    breaker(docs)
    assert POLICIES[policy](docs, "base"), f"the {policy} policy missed a broken manifest"


def test_schema_check_catches_a_broken_manifest():
    docs = render("base")
    _break_schema(docs)
    assert schema_problems(docs)
    docs = render("overlays/lws")
    find(docs, "LeaderWorkerSet", "dyad-llm")["spec"]["leaderWorkerTemplate"]["workerTemplate"][
        "spec"]["containers"][0]["bogus"] = 1
    assert schema_problems(docs)
