"""Rendering and checking the Kubernetes manifests (`k8s/`) without a cluster: what
tests/integration/test_k8s_manifests.py runs.

Every kustomization renders with `kubectl kustomize`, every object validates strictly (unknown
fields are errors) against the Kubernetes 1.33 API schemas bundled with `kubernetes-validate`
(offline), and the rendered objects meet the deployment's policies: the contract's names and
wiring, pools on disjoint GPU node pools, probes, no privilege, resource limits, shared memory,
the router's exact RBAC, and tokens only where they belong.

The LeaderWorkerSet of `overlays/lws` is a custom resource that kubernetes-validate has no schema
for: everything else in that overlay is validated strictly, the LeaderWorkerSet's own fields are
checked here against the LWS v1 API (required fields, enums, no unknown keys), and its pod
templates are validated strictly as core/v1 PodTemplates.

Each policy is a function returning the problems it finds.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dyad.pools import pool_names

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
KUBERNETES_VERSION = "1.33"
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/rdma", "overlays/lws"]
LWS_API = "leaderworkerset.x-k8s.io/v1"

# Exactly what the issue allows: resize through the scale subresource, follow the pods. The fake
# API server of tests/integration/test_k8s_launcher.py refuses the launcher anything else (403).
ROUTER_RULES = {
    ("apps", "statefulsets/scale", "get"),
    ("apps", "statefulsets/scale", "patch"),
    ("", "pods", "get"),
    ("", "pods", "list"),
    ("", "pods", "watch"),
}
LWS_RULES = {
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale", "get"),
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale", "patch"),
}
# Capabilities a container may add back after dropping ALL, per kustomization.
ALLOWED_CAPABILITIES = {"overlays/rdma": {"IPC_LOCK"}}


# ----------------------------------------------------------------------------- rendering


@functools.cache
def _render(kustomization: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomizations cannot be rendered here")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/{kustomization} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(kustomization: str) -> list[dict]:
    """A fresh copy of the rendered objects (tests may mutate it)."""
    return copy.deepcopy(list(_render(kustomization)))


def find(docs: list[dict], kind: str, name: str) -> dict | None:
    return next(
        (d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None
    )


def pool_workloads(docs: list[dict]) -> dict[str, dict]:
    """pool -> its workload (a StatefulSet, or the lws overlay's LeaderWorkerSet for the LLM)."""
    found = {}
    for doc in docs:
        component = doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if doc["kind"] in ("StatefulSet", "LeaderWorkerSet") and component in pool_names():
            found[component] = doc
    return found


def pod_templates(workload: dict) -> list[dict]:
    if workload["kind"] == "LeaderWorkerSet":
        lwt = workload["spec"]["leaderWorkerTemplate"]
        return [lwt[key] for key in ("workerTemplate", "leaderTemplate") if key in lwt]
    return [workload["spec"]["template"]]


def pool_pods(docs: list[dict]) -> dict[str, list[dict]]:
    """pool -> its pod specs."""
    return {
        pool: [t["spec"] for t in pod_templates(w)] for pool, w in pool_workloads(docs).items()
    }


def router_pod(docs: list[dict]) -> dict:
    return find(docs, "Deployment", "dyad-router")["spec"]["template"]["spec"]


def all_pods(docs: list[dict]) -> list[tuple[str, dict]]:
    pods = [("router", router_pod(docs))]
    for pool, specs in pool_pods(docs).items():
        pods += [(pool, spec) for spec in specs]
    return pods


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def env_source(container: dict, name: str) -> dict:
    """The valueFrom of an env var ({} when it is a plain value or absent)."""
    return env_of(container).get(name, {}).get("valueFrom", {})


def secrets_referenced(pod: dict) -> set[str]:
    """Every Secret a pod spec can read: volumes (plain and projected), env and envFrom."""
    names = set()
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                names.add(source["secretRef"]["name"])
    return names


def mounts_by_path(container: dict, pod: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes.get(m["name"], {}) for m in container.get("volumeMounts", [])}


# ----------------------------------------------------------------------------- schema checks


def schema_problems(docs: list[dict]) -> list[str]:
    import kubernetes_validate

    problems = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] == LWS_API and doc["kind"] == "LeaderWorkerSet":
            problems += [f"{where}: {p}" for p in leaderworkerset_problems(doc)]
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(p) for p in error.path)
            problems.append(f"{where}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{where}: {error.message}")
    return problems


# From the LWS v1 API (sigs.k8s.io/lws api/leaderworkerset/v1/leaderworkerset_types.go).
_LWS_SPEC_KEYS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
                  "networkConfig"}
_LWS_TEMPLATE_KEYS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                      "subGroupPolicy", "volumeClaimTemplates",
                      "persistentVolumeClaimRetentionPolicy"}
_LWS_RESTART_POLICIES = {"Default", "None", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart"}
_LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}
_LWS_SUBDOMAIN_POLICIES = {"Shared", "UniquePerReplica"}


def leaderworkerset_problems(lws: dict) -> list[str]:
    import kubernetes_validate

    problems = []
    if unknown := set(lws) - {"apiVersion", "kind", "metadata", "spec"}:
        problems.append(f"unknown top-level keys {sorted(unknown)}")
    if not lws.get("metadata", {}).get("name"):
        problems.append("metadata.name is required")
    spec = lws.get("spec", {})
    if unknown := set(spec) - _LWS_SPEC_KEYS:
        problems.append(f"spec: unknown keys {sorted(unknown)}")
    lwt = spec.get("leaderWorkerTemplate")
    if not isinstance(lwt, dict) or "workerTemplate" not in lwt:
        return problems + ["spec.leaderWorkerTemplate.workerTemplate is required"]
    if unknown := set(lwt) - _LWS_TEMPLATE_KEYS:
        problems.append(f"spec.leaderWorkerTemplate: unknown keys {sorted(unknown)}")
    size = lwt.get("size", 1)
    if not isinstance(size, int) or size < 1:
        problems.append(f"spec.leaderWorkerTemplate.size must be an integer >= 1, got {size!r}")
    if lwt.get("restartPolicy", "RecreateGroupOnPodRestart") not in _LWS_RESTART_POLICIES:
        problems.append(f"spec.leaderWorkerTemplate.restartPolicy: {lwt['restartPolicy']!r}")
    if spec.get("startupPolicy", "LeaderCreated") not in _LWS_STARTUP_POLICIES:
        problems.append(f"spec.startupPolicy: {spec['startupPolicy']!r}")
    network = spec.get("networkConfig", {})
    if network and network.get("subdomainPolicy") not in _LWS_SUBDOMAIN_POLICIES:
        problems.append(f"spec.networkConfig.subdomainPolicy: {network.get('subdomainPolicy')!r}")
    for key in ("workerTemplate", "leaderTemplate"):
        if key not in lwt:
            continue
        pod_template = {
            "apiVersion": "v1", "kind": "PodTemplate",
            "metadata": {"name": f"{lws['metadata'].get('name', '?')}-{key}"},
            "template": lwt[key],
        }
        try:
            kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(p) for p in error.path)
            problems.append(f"spec.leaderWorkerTemplate.{key}: {path}: {error.message}")
    return problems


# ----------------------------------------------------------------------------- policies


def contract_problems(docs: list[dict], kustomization: str) -> list[str]:
    """The names and wiring the code relies on (docs/deploy.md, "What the code expects")."""
    problems = []
    expected = [
        ("ServiceAccount", "dyad-router"), ("ServiceAccount", "dyad-worker"),
        ("Role", "dyad-router"), ("RoleBinding", "dyad-router"),
        ("ConfigMap", "dyad-run-config"), ("PersistentVolumeClaim", "dyad-router-state"),
        ("PersistentVolumeClaim", "dyad-runs"), ("Deployment", "dyad-router"),
        ("Service", "dyad-router"), ("StatefulSet", "dyad-encoder"), ("Service", "dyad-encoder"),
    ]
    if kustomization == "overlays/lws":
        expected.append(("LeaderWorkerSet", "dyad-llm"))
    else:
        expected += [("StatefulSet", "dyad-llm"), ("Service", "dyad-llm")]
    problems += [f"missing {kind}/{name}" for kind, name in expected if not find(docs, kind, name)]
    if problems:
        return problems

    for pool, workload in pool_workloads(docs).items():
        where = f"{workload['kind']}/dyad-{pool}"
        if "replicas" in workload["spec"]:
            problems.append(f"{where}: sets replicas (the router owns them; apply would reset)")
        labels = workload["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/name") != "dyad":
            problems.append(f"{where}: label app.kubernetes.io/name is not dyad")
        for template in pod_templates(workload):
            template_labels = template["metadata"].get("labels", {})
            if template_labels.get("app.kubernetes.io/component") != pool:
                problems.append(f"{where}: pod template not labelled component={pool}")
            if template_labels.get("app.kubernetes.io/name") != "dyad":
                problems.append(f"{where}: pod template not labelled name=dyad")
            (container,) = template["spec"]["containers"]
            if container.get("args") != ["worker", "--pool", pool]:
                problems.append(f"{where}: args {container.get('args')}")
            env = env_of(container)
            if env.get("DYAD_ROUTER", {}).get("value") != "dyad-router:50051":
                problems.append(f"{where}: DYAD_ROUTER is not dyad-router:50051")
            for name, field in [("POD_NAME", "metadata.name"), ("POD_IP", "status.podIP"),
                                ("POD_NAMESPACE", "metadata.namespace")]:
                if env_source(container, name).get("fieldRef", {}).get("fieldPath") != field:
                    problems.append(f"{where}: {name} is not the downward API's {field}")
            ports = {p["containerPort"] for p in container.get("ports", [])}
            if not {8081, 29500} <= ports:
                problems.append(f"{where}: ports {sorted(ports)} lack 8081 (health) or 29500")
        if workload["kind"] == "StatefulSet":
            spec = workload["spec"]
            if spec.get("serviceName") != f"dyad-{pool}":
                problems.append(f"{where}: serviceName {spec.get('serviceName')!r}")
            if spec.get("podManagementPolicy") != "Parallel":
                problems.append(f"{where}: podManagementPolicy is not Parallel")
            service = find(docs, "Service", f"dyad-{pool}")
            if service is None:
                problems.append(f"{where}: no headless Service dyad-{pool}")
                continue
            sspec = service["spec"]
            if sspec.get("clusterIP") != "None" or not sspec.get("publishNotReadyAddresses"):
                problems.append(f"Service/dyad-{pool}: not headless with unready addresses")
            service_ports = {(p.get("name"), p["port"]) for p in sspec.get("ports", [])}
            if service_ports != {("rendezvous", 29500)}:
                problems.append(f"Service/dyad-{pool}: ports {sorted(service_ports)}")
            if sspec.get("selector", {}).get("app.kubernetes.io/component") != pool:
                problems.append(f"Service/dyad-{pool}: selector {sspec.get('selector')}")

    deployment = find(docs, "Deployment", "dyad-router")
    if deployment["spec"].get("replicas") != 1:
        problems.append("Deployment/dyad-router: replicas is not 1")
    if deployment["spec"].get("strategy", {}).get("type") != "Recreate":
        problems.append("Deployment/dyad-router: strategy is not Recreate")
    pod = router_pod(docs)
    if pod.get("serviceAccountName") != "dyad-router":
        problems.append("router pod: serviceAccountName is not dyad-router")
    (router,) = pod["containers"]
    args = router.get("args", [])
    for flag in ["--host=0.0.0.0", "--port=50051", "--metrics-port=9090", "--launcher=kubernetes",
                 "--state-db=/var/lib/dyad/router.db"]:
        if flag not in args:
            problems.append(f"router: argument {flag} missing")
    if args[:1] != ["router"]:
        problems.append(f"router: args start with {args[:1]}, not 'router'")
    if env_source(router, "POD_NAMESPACE").get("fieldRef", {}).get("fieldPath") != (
        "metadata.namespace"
    ):
        problems.append("router: POD_NAMESPACE is not the downward API's metadata.namespace")
    mounts = mounts_by_path(router, pod)
    state = mounts.get("/var/lib/dyad", {}).get("persistentVolumeClaim", {})
    if state.get("claimName") != "dyad-router-state":
        problems.append("router: /var/lib/dyad is not the dyad-router-state volume")
    if mounts.get("/etc/dyad/config", {}).get("configMap", {}).get("name") != "dyad-run-config":
        problems.append("router: /etc/dyad/config is not the dyad-run-config ConfigMap")
    service = find(docs, "Service", "dyad-router")
    ports = {(p.get("name"), p["port"]) for p in service["spec"].get("ports", [])}
    if ports != {("grpc", 50051), ("metrics", 9090)}:
        problems.append(f"Service/dyad-router: ports {sorted(ports)}")
    return problems


def shared_runs_problems(docs: list[dict]) -> list[str]:
    """The runs' out_dir (checkpoints, manifests) is one ReadWriteMany volume at the same path in
    the router and every pool pod; the router's runs/<id> resolves onto it."""
    problems = []
    claim = find(docs, "PersistentVolumeClaim", "dyad-runs")
    if claim is None or "ReadWriteMany" not in claim["spec"].get("accessModes", []):
        problems.append("PersistentVolumeClaim/dyad-runs is missing or not ReadWriteMany")
    for owner, pod in all_pods(docs):
        for container in pod["containers"]:
            volume = mounts_by_path(container, pod).get("/var/lib/dyad/runs", {})
            if volume.get("persistentVolumeClaim", {}).get("claimName") != "dyad-runs":
                problems.append(f"{owner}: dyad-runs is not mounted at /var/lib/dyad/runs")
    if router_pod(docs)["containers"][0].get("workingDir") != "/var/lib/dyad":
        problems.append("router: workingDir is not /var/lib/dyad (runs/<id> goes onto dyad-runs)")
    return problems


def _node_selector(pod: dict) -> dict[str, str]:
    return pod.get("nodeSelector", {})


def node_pool_problems(docs: list[dict]) -> list[str]:
    """Each pool on its own GPU node pool: node selectors that no node can satisfy both of."""
    problems = []
    pods = pool_pods(docs)
    if set(pods) != set(pool_names()):
        return [f"pools found: {sorted(pods)}"]
    selectors = {pool: [_node_selector(spec) for spec in specs] for pool, specs in pods.items()}
    for pool, specs in pods.items():
        for spec in specs:
            if not _node_selector(spec):
                problems.append(f"{pool}: no nodeSelector")
            tolerations = spec.get("tolerations", [])
            if not any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule"
                       for t in tolerations):
                problems.append(f"{pool}: no NoSchedule toleration for nvidia.com/gpu")
    for encoder in selectors["encoder"]:
        for llm in selectors["llm"]:
            if not any(key in llm and llm[key] != value for key, value in encoder.items()):
                problems.append(f"node selectors overlap: encoder {encoder}, llm {llm}")
    return problems


def probe_problems(docs: list[dict]) -> list[str]:
    """Readiness and liveness gRPC health probes on every container, on its health port."""
    problems = []
    for owner, pod in all_pods(docs):
        port = 50051 if owner == "router" else 8081
        for container in pod["containers"]:
            for kind in ("readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                if not probe or probe.get("grpc", {}).get("port") != port:
                    problems.append(f"{owner}/{container['name']}: no gRPC {kind} on port {port}")
    return problems


def privilege_problems(docs: list[dict], kustomization: str) -> list[str]:
    """Non-root, no privilege escalation, every capability dropped (IPC_LOCK back for RDMA),
    RuntimeDefault seccomp, no host namespaces or host paths."""
    allowed = ALLOWED_CAPABILITIES.get(kustomization, set())
    problems = []
    for owner, pod in all_pods(docs):
        pod_context = pod.get("securityContext", {})
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(flag):
                problems.append(f"{owner}: {flag}")
        problems += [f"{owner}: hostPath volume {v['name']}" for v in pod.get("volumes", [])
                     if "hostPath" in v]
        for container in pod["containers"] + pod.get("initContainers", []):
            where = f"{owner}/{container['name']}"
            context = {**pod_context, **container.get("securityContext", {})}
            if context.get("privileged"):
                problems.append(f"{where}: privileged")
            if context.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if context.get("runAsNonRoot") is not True:
                problems.append(f"{where}: runAsNonRoot is not true")
            if context.get("runAsUser", 0) == 0:
                problems.append(f"{where}: runs as uid 0 (or unset)")
            if context.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                problems.append(f"{where}: seccompProfile is not RuntimeDefault")
            capabilities = context.get("capabilities", {})
            if "ALL" not in capabilities.get("drop", []):
                problems.append(f"{where}: capabilities do not drop ALL")
            if extra := set(capabilities.get("add", [])) - allowed:
                problems.append(f"{where}: adds capabilities {sorted(extra)}")
    return problems


def resource_problems(docs: list[dict]) -> list[str]:
    """cpu and memory requests and limits everywhere; GPUs only on pool pods, requests = limits
    = DYAD_GPUS_PER_POD = the router's DYAD_<POOL>_GPUS_PER_POD; pool pods Guaranteed
    (requests = limits)."""
    problems = []
    (router,) = router_pod(docs)["containers"]
    for pool, specs in pool_pods(docs).items():
        name = f"DYAD_{pool.upper()}_GPUS_PER_POD"
        counted = env_of(router).get(name, {}).get("value")
        for spec in specs:
            limits = spec["containers"][0].get("resources", {}).get("limits", {})
            gpus = limits.get("nvidia.com/gpu")
            if counted != str(gpus):
                problems.append(f"router: {name} {counted!r} != the {pool} pods' {gpus} GPUs")
    for owner, pod in all_pods(docs):
        for container in pod["containers"]:
            where = f"{owner}/{container['name']}"
            resources = container.get("resources", {})
            requests, limits = resources.get("requests", {}), resources.get("limits", {})
            for key in ("cpu", "memory"):
                if key not in requests or key not in limits:
                    problems.append(f"{where}: no {key} request and limit")
            gpus = limits.get("nvidia.com/gpu")
            if owner == "router":
                if gpus is not None or "nvidia.com/gpu" in requests:
                    problems.append(f"{where}: asks for GPUs")
                continue
            if requests != limits:
                problems.append(f"{where}: requests {requests} differ from limits {limits}")
            if not isinstance(gpus, int) or gpus < 1:
                problems.append(f"{where}: nvidia.com/gpu limit {gpus!r}")
            per_pod = env_of(container).get("DYAD_GPUS_PER_POD", {}).get("value")
            if per_pod != str(gpus):
                problems.append(f"{where}: DYAD_GPUS_PER_POD {per_pod!r} != {gpus} GPUs")
    return problems


def shm_problems(docs: list[dict]) -> list[str]:
    problems = []
    for pool, specs in pool_pods(docs).items():
        for spec in specs:
            for container in spec["containers"]:
                shm = mounts_by_path(container, spec).get("/dev/shm", {}).get("emptyDir")
                if shm is None or shm.get("medium") != "Memory" or not shm.get("sizeLimit"):
                    problems.append(f"{pool}: /dev/shm is not a sized memory-backed emptyDir")
    return problems


def rbac_problems(docs: list[dict], kustomization: str) -> list[str]:
    """The router's Role grants exactly the listed rules, bound to its ServiceAccount only;
    nothing cluster-wide; pool pods run without API credentials."""
    problems = []
    expected = ROUTER_RULES | (LWS_RULES if kustomization == "overlays/lws" else set())
    for doc in docs:
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: nothing cluster-wide")
        if doc["kind"] in ("Role", "RoleBinding") and doc["metadata"]["name"] != "dyad-router":
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: unexpected")
    role = find(docs, "Role", "dyad-router")
    granted = set()
    for rule in role.get("rules", []):
        if set(rule) - {"apiGroups", "resources", "verbs"}:
            problems.append(f"Role/dyad-router: rule with {sorted(set(rule))} (names, URLs)")
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    if "*" in (group, resource, verb):
                        problems.append(f"Role/dyad-router: wildcard in {rule}")
                    granted.add((group, resource, verb))
    if granted != expected:
        if extra := granted - expected:
            problems.append(f"Role/dyad-router grants more: {sorted(extra)}")
        if missing := expected - granted:
            problems.append(f"Role/dyad-router lacks: {sorted(missing)}")
    binding = find(docs, "RoleBinding", "dyad-router")
    if binding["roleRef"] != {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                              "name": "dyad-router"}:
        problems.append(f"RoleBinding/dyad-router: roleRef {binding['roleRef']}")
    subjects = [(s["kind"], s["name"]) for s in binding.get("subjects", [])]
    if subjects != [("ServiceAccount", "dyad-router")]:
        problems.append(f"RoleBinding/dyad-router: subjects {subjects}")
    worker_account = find(docs, "ServiceAccount", "dyad-worker")
    if worker_account.get("automountServiceAccountToken") is not False:
        problems.append("ServiceAccount/dyad-worker: automountServiceAccountToken is not false")
    for pool, specs in pool_pods(docs).items():
        for spec in specs:
            if spec.get("serviceAccountName") != "dyad-worker":
                problems.append(f"{pool}: serviceAccountName is not dyad-worker")
            if spec.get("automountServiceAccountToken") is not False:
                problems.append(f"{pool}: automountServiceAccountToken is not false")
    return problems


def token_problems(docs: list[dict]) -> list[str]:
    """The router reads both tokens from files; pool pods get only the join token, as env."""
    problems = []
    pod = router_pod(docs)
    (router,) = pod["containers"]
    mounts = mounts_by_path(router, pod)
    for secret, path in [("dyad-client-token", "/etc/dyad/client-token"),
                         ("dyad-join-token", "/etc/dyad/join-token")]:
        if mounts.get(path, {}).get("secret", {}).get("secretName") != secret:
            problems.append(f"router: Secret {secret} is not mounted at {path}")
    args = router.get("args", [])
    for flag in ("--token-file=/etc/dyad/client-token/token",
                 "--join-token-file=/etc/dyad/join-token/token"):
        if flag not in args:
            problems.append(f"router: argument {flag} missing")
    if "DYAD_TOKEN" in env_of(router):
        problems.append("router: the client token belongs in a file, not in the environment")
    for pool, specs in pool_pods(docs).items():
        for spec in specs:
            if "dyad-client-token" in secrets_referenced(spec):
                problems.append(f"{pool}: can read the client token")
            (container,) = spec["containers"]
            ref = env_source(container, "DYAD_JOIN_TOKEN").get("secretKeyRef")
            if ref != {"name": "dyad-join-token", "key": "token"}:
                problems.append(f"{pool}: DYAD_JOIN_TOKEN is not dyad-join-token's token")
    return problems


POLICIES = {
    "contract": lambda docs, k: contract_problems(docs, k),
    "shared runs volume": lambda docs, k: shared_runs_problems(docs),
    "node pools": lambda docs, k: node_pool_problems(docs),
    "probes": lambda docs, k: probe_problems(docs),
    "privilege": privilege_problems,
    "resources": lambda docs, k: resource_problems(docs),
    "/dev/shm": lambda docs, k: shm_problems(docs),
    "rbac": rbac_problems,
    "tokens": lambda docs, k: token_problems(docs),
}

