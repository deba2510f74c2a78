"""KubernetesLauncher against the fake API server of tests/helpers/k8s_fake_api.py, which authorizes
with the router's Role: every test fails if the launcher asked for anything more."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from dyad.router.k8s import KubernetesError, KubernetesLauncher, gpus_per_pod_from_env
from dyad.router.launcher import WorkerSpec
from tests.helpers.k8s_fake_api import NS, FakeApiServer, statefulset_manifest

GPUS_PER_POD = {"encoder": 1, "llm": 2}  # what the router's environment says


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()
    assert not server.forbidden, "the launcher asked for more than the router's Role grants"


def make_launcher(api, **options) -> KubernetesLauncher:
    options = {"watch_timeout_s": 5, "request_timeout_s": 5, "backoff_s": (0.05, 0.2)} | options
    return KubernetesLauncher(
        NS, client.ApiClient(client.Configuration(host=api.url)), gpus_per_pod=GPUS_PER_POD,
        **options,
    )


@pytest.fixture
def launcher(api):
    launcher = make_launcher(api)
    yield launcher
    launcher.close()


def eventually(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not true within {timeout_s}s: {predicate.__doc__ or predicate}")


def start(launcher, llm: int = 4, encoder: int = 2, tmp_path=None) -> None:
    workers = [WorkerSpec("encoder", r) for r in range(encoder)]
    workers += [WorkerSpec("llm", r) for r in range(llm)]
    launcher.start("run", "router:50051", workers, tmp_path)


def dead_ranks(launcher) -> list[tuple[str, int]]:
    return sorted((spec.pool, spec.rank) for spec, _ in launcher.dead())


def _is_watch(request: dict) -> bool:
    return request["query"].get("watch", "").lower() == "true"


def watches(api) -> list[dict]:
    return [r for r in api.calls("GET", f"/api/v1/namespaces/{NS}/pods") if _is_watch(r)]


def lists(api) -> list[dict]:
    return [r for r in api.calls("GET", f"/api/v1/namespaces/{NS}/pods") if not _is_watch(r)]


# ---------------------------------------------------------------------- scaling


def test_start_scales_statefulsets_through_the_scale_subresource(api, launcher, tmp_path):
    assert launcher.rendezvous(["llm"]) == {"llm": "dyad-llm-0.dyad-llm.ns.svc:29500"}
    start(launcher, llm=4, encoder=3, tmp_path=tmp_path)

    llm_scale = f"/apis/apps/v1/namespaces/{NS}/statefulsets/dyad-llm/scale"
    patches = api.calls("PATCH", llm_scale)
    assert [(p["body"], p["content_type"]) for p in patches] == [
        ({"spec": {"replicas": 2}}, "application/strategic-merge-patch+json")  # 4 ranks, 2 a pod
    ]
    encoder = api.calls("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/dyad-encoder/scale")
    assert [p["body"] for p in encoder] == [{"spec": {"replicas": 3}}]  # 1 per pod
    assert {(r["method"], r["path"].rpartition("/")[2]) for r in api.requests} == {
        ("GET", "scale"), ("PATCH", "scale"), ("GET", "pods")  # the StatefulSets are not read
    }

    start(launcher, llm=4, encoder=3, tmp_path=tmp_path)  # nothing to change: no patch
    assert api.calls("PATCH", llm_scale) == patches

    with pytest.raises(ValueError, match=(
        r"llm pool has 3 ranks, not a multiple of the 2 workers per pod of statefulset dyad-llm "
        r"\(\$DYAD_LLM_GPUS_PER_POD\)"
    )):
        start(launcher, llm=3, encoder=3, tmp_path=tmp_path)


def test_the_fake_api_server_refuses_what_the_role_does_not_grant(api):
    """What makes every other test here an RBAC check of the launcher."""
    core = client.CoreV1Api(client.ApiClient(client.Configuration(host=api.url)))
    apps = client.AppsV1Api(core.api_client)
    with pytest.raises(ApiException) as refused:
        core.delete_namespaced_pod("dyad-llm-0", NS)
    assert refused.value.status == 403
    assert 'cannot delete resource "pods"' in json.loads(refused.value.body)["message"]
    with pytest.raises(ApiException, match="Forbidden"):
        apps.read_namespaced_stateful_set("dyad-llm", NS)
    assert [(r["method"], r["path"]) for r in api.forbidden] == [
        ("DELETE", f"/api/v1/namespaces/{NS}/pods/dyad-llm-0"),
        ("GET", f"/apis/apps/v1/namespaces/{NS}/statefulsets/dyad-llm"),
    ]
    api.forbidden.clear()  # asked by this test, not by the launcher


def test_workers_per_pod_come_from_the_routers_environment():
    environ = {"DYAD_ENCODER_GPUS_PER_POD": "1", "DYAD_LLM_GPUS_PER_POD": "8"}
    assert gpus_per_pod_from_env(environ) == {"encoder": 1, "llm": 8}
    for name, value in [("DYAD_LLM_GPUS_PER_POD", None), ("DYAD_LLM_GPUS_PER_POD", "0"),
                        ("DYAD_ENCODER_GPUS_PER_POD", "two")]:
        broken = {k: v for k, v in (environ | {name: value}).items() if v is not None}
        with pytest.raises(ValueError, match=rf"\${name} must be a whole number >= 1"):
            gpus_per_pod_from_env(broken)
    with pytest.raises(ValueError, match="gpus_per_pod must give each of"):
        KubernetesLauncher(NS, client.ApiClient(), gpus_per_pod={"llm": 2})


def test_a_pod_running_another_number_of_workers_fails_the_run(api, launcher, tmp_path):
    """A pod's ranks are ordinal x its own DYAD_GPUS_PER_POD: if that is not what the router
    counts, no recovery can help (e.g. the pool's GPUs changed in an overlay, the router's
    count did not, or the pods are of an older template)."""
    api.statefulsets["dyad-llm"] = statefulset_manifest("dyad-llm", {"DYAD_GPUS_PER_POD": "4"}, gpus=4)
    start(launcher, tmp_path=tmp_path)
    eventually(lambda: len(launcher.pods()) == 4)
    with pytest.raises(ValueError, match=(
        r"pod dyad-llm-0 runs 4 workers \(its DYAD_GPUS_PER_POD\) but the router's "
        r"\$DYAD_LLM_GPUS_PER_POD is 2"
    )):
        launcher.dead()


def test_api_errors_name_the_call_status_and_reason(api, launcher, tmp_path):
    del api.statefulsets["dyad-llm"]
    with pytest.raises(KubernetesError, match=(
        r'read the scale of statefulset dyad-llm in namespace ns: 404 Not Found: '
        r'statefulsets.apps "dyad-llm" not found'
    )):
        start(launcher, tmp_path=tmp_path)


def test_in_cluster_config_else_the_kubeconfig(api, tmp_path, monkeypatch):
    """Outside a pod the in-cluster loader raises ConfigException; the launcher then loads
    $KUBECONFIG (as it is when the launcher is made) into its own client configuration, and
    talks to the server and with the credentials that file names."""
    tried = []

    def not_in_a_pod(client_configuration=None, **kwargs):
        tried.append(client_configuration)
        raise config.ConfigException("Service host/port is not set.")

    monkeypatch.setattr(config, "load_incluster_config", not_in_a_pod)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "router", "user": {"token": "kubeconfig-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    default_host = client.Configuration.get_default_copy().host

    launcher = KubernetesLauncher(NS, gpus_per_pod=GPUS_PER_POD, request_timeout_s=5)
    try:
        start(launcher, tmp_path=tmp_path)
        eventually(lambda: len(launcher.pods()) == 4)
    finally:
        launcher.close()
    assert len(tried) == 1 and tried[0] is not None  # its own configuration, tried first
    llm_scale = f"/apis/apps/v1/namespaces/{NS}/statefulsets/dyad-llm/scale"
    assert len(api.calls("PATCH", llm_scale)) == 1
    assert {r["authorization"] for r in api.requests} == {"Bearer kubeconfig-token"}
    assert client.Configuration.get_default_copy().host == default_host  # no global change


def test_end_of_run_scales_every_pool_to_zero(api, launcher, tmp_path):
    start(launcher, tmp_path=tmp_path)
    launcher.stop(timeout_s=1.0)
    for name in ("dyad-encoder", "dyad-llm"):
        patches = api.calls("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}/scale")
        assert patches[-1]["body"] == {"spec": {"replicas": 0}}
    assert not api.pods and launcher.dead() == []
    eventually(lambda: not launcher._watcher.is_alive())


# ---------------------------------------------------------------------- the pod watch and dead()


def test_a_container_restart_or_a_lost_pod_is_a_dead_worker(api, launcher, tmp_path):
    start(launcher, tmp_path=tmp_path)
    pods = eventually(lambda: len(launcher.pods()) == 4 and launcher.pods())
    assert {n: (p.pool, p.phase, p.ready, p.restarts, p.deleted) for n, p in pods.items()} == {
        "dyad-encoder-0": ("encoder", "Running", True, 0, False),
        "dyad-encoder-1": ("encoder", "Running", True, 0, False),
        "dyad-llm-0": ("llm", "Running", True, 0, False),
        "dyad-llm-1": ("llm", "Running", True, 0, False),
    }
    assert launcher.dead() == []

    api.restart("dyad-llm-1")  # both of its ranks are gone
    dead = eventually(launcher.dead)
    assert sorted((s.pool, s.rank) for s, _ in dead) == [("llm", 2), ("llm", 3)]
    assert "(pod dyad-llm-1) container restarted (restartCount 0 -> 1)" in dead[0][1]
    assert "OOMKilled (exit code 137)" in dead[0][1]

    api.delete("dyad-encoder-0")  # and created again by its StatefulSet
    eventually(lambda: ("encoder", 0) in dead_ranks(launcher))
    api.change("dyad-encoder-1", phase="Failed")
    eventually(lambda: ("encoder", 1) in dead_ranks(launcher))
    reasons = {s: r for s, r in launcher.dead()}
    assert reasons[WorkerSpec("encoder", 0)] == "(pod dyad-encoder-0) was deleted and created again"
    assert reasons[WorkerSpec("encoder", 1)] == "(pod dyad-encoder-1) failed"


def test_a_410_gone_mid_watch_lists_again_and_goes_on(api, launcher, tmp_path):
    start(launcher, tmp_path=tmp_path)
    eventually(lambda: len(watches(api)) == 1)
    assert len(lists(api)) == 1

    # While the history is compacted away, llm-0's container restarts and encoder-1 is deleted
    # (its StatefulSet did not recreate it yet): only a new list shows it.
    def unseen():
        api.restart("dyad-llm-0", silently=True)
        api._delete_pod("dyad-encoder-1", silently=True)

    api.expire(unseen)
    eventually(lambda: dead_ranks(launcher) == [("encoder", 1), ("llm", 0), ("llm", 1)])
    assert len(lists(api)) == 2
    pods = launcher.pods()
    assert pods["dyad-encoder-1"].deleted and pods["dyad-llm-0"].restarts == 1
    eventually(lambda: len(watches(api)) == 2)
    assert watches(api)[-1]["query"]["resourceVersion"] == str(api.version)

    api.restart("dyad-encoder-0")  # the new watch delivers events
    eventually(lambda: ("encoder", 0) in dead_ranks(launcher))


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["error-event", "http-410"])
def test_a_410_gone_on_reconnect_lists_again(api, launcher, tmp_path, gone_as_status):
    api.gone_as_status = gone_as_status
    start(launcher, tmp_path=tmp_path)
    eventually(lambda: len(watches(api)) == 1)
    api.drop(compact=True)  # the reconnect's resourceVersion is too old by then
    eventually(lambda: len(lists(api)) == 2)
    api.restart("dyad-llm-1")
    eventually(lambda: dead_ranks(launcher) == [("llm", 2), ("llm", 3)])


def test_a_watch_that_times_out_watches_again_from_the_last_resource_version(api, tmp_path, caplog):
    """The server ends every watch after timeoutSeconds: that is no error (no warning, no
    back-off) and needs no new list; the next watch starts after the last event applied."""
    launcher = make_launcher(api, watch_timeout_s=1)
    try:
        with caplog.at_level(logging.INFO, logger="dyad.router.k8s"):
            start(launcher, tmp_path=tmp_path)
            eventually(lambda: len(watches(api)) == 1)
            assert watches(api)[0]["query"]["timeoutSeconds"] == "1"
            api.restart("dyad-llm-0")
            eventually(lambda: dead_ranks(launcher) == [("llm", 0), ("llm", 1)])
            seen, watched = api.version, len(watches(api))
            eventually(lambda: len(watches(api)) >= watched + 2, timeout_s=10)  # two timeouts on
            assert [w["query"]["resourceVersion"] for w in watches(api)[watched:]] == (
                [str(seen)] * (len(watches(api)) - watched)
            )
            api.restart("dyad-encoder-0")  # and the next watch delivers events
            eventually(lambda: ("encoder", 0) in dead_ranks(launcher))
        assert len(lists(api)) == 1
        assert [r.getMessage() for r in caplog.records if "pod watch" in r.getMessage()] == []
    finally:
        launcher.close()


def test_a_dropped_connection_watches_again_from_the_last_resource_version(api, launcher, tmp_path):
    start(launcher, tmp_path=tmp_path)
    eventually(lambda: len(watches(api)) == 1)
    api.restart("dyad-llm-0")
    eventually(lambda: dead_ranks(launcher) == [("llm", 0), ("llm", 1)])
    seen = api.version

    api.drop()  # mid-event: the half event is not applied, and no event is lost
    eventually(lambda: len(watches(api)) == 2)
    assert watches(api)[-1]["query"]["resourceVersion"] == str(seen)
    assert len(lists(api)) == 1  # watched again, not listed again

    api.restart("dyad-encoder-0")
    eventually(lambda: ("encoder", 0) in dead_ranks(launcher))


# ---------------------------------------------------------------------- stop


def test_stop_waits_for_containers_to_exit_and_leaves_a_hung_pod_to_restart(
    api, launcher, tmp_path, caplog
):
    """No pod is deleted (the Role does not allow it). A pod whose workers do not exit when told
    to restarts its container later (they exit once released, or its supervisor stops them):
    that restart is expected, as are the prompt ones; one more is a crash."""
    start(launcher, tmp_path=tmp_path)
    eventually(lambda: len(launcher.pods()) == 4)
    llm_0, llm_1 = (api.pods[f"dyad-llm-{i}"]["metadata"]["uid"] for i in (0, 1))
    threading.Timer(0.1, api.exit, ["dyad-llm-0"]).start()  # dyad-llm-1 hangs

    started = time.monotonic()
    launcher.stop(["llm"], timeout_s=1.5)
    assert 1.5 <= time.monotonic() - started < 5.0
    assert launcher.dead() == []  # stopped workers are not dead
    [hung] = [r.getMessage() for r in caplog.records if "did not exit" in r.getMessage()]  # one line
    assert "(dyad-llm-1)" in hung and "dyad-llm-0" not in hung

    # The next generation starts while dyad-llm-1 still hangs; then both containers restart,
    # dyad-llm-1's late: neither is a lost worker.
    start(launcher, tmp_path=tmp_path)
    assert launcher.dead() == []
    api.restart("dyad-llm-0")
    eventually(lambda: launcher.pods()["dyad-llm-0"].restarts == 1)
    assert launcher.dead() == []
    api.restart("dyad-llm-1")
    eventually(lambda: launcher.pods()["dyad-llm-1"].restarts == 1)
    assert launcher.dead() == []
    assert [api.pods[f"dyad-llm-{i}"]["metadata"]["uid"] for i in (0, 1)] == [llm_0, llm_1]

    # Told to stop again, both exit at once: no waiting out the timeout.
    for name in ("dyad-llm-0", "dyad-llm-1"):
        threading.Timer(0.1, api.exit, [name]).start()
    started = time.monotonic()
    launcher.stop(["llm"], timeout_s=5.0)
    assert time.monotonic() - started < 4.0

    start(launcher, tmp_path=tmp_path)
    api.restart("dyad-llm-0")  # the restart stop asked for
    api.restart("dyad-llm-0")  # and one it did not: a crash
    eventually(lambda: dead_ranks(launcher) == [("llm", 0), ("llm", 1)])


def test_a_hung_pod_replaced_instead_of_restarted_is_a_lost_worker(api, launcher, tmp_path):
    """E.g. its node was drained while it hung: the StatefulSet's new pod has new workers."""
    start(launcher, tmp_path=tmp_path)
    eventually(lambda: len(launcher.pods()) == 4)
    launcher.stop(["llm"], timeout_s=0.5)  # neither exits
    start(launcher, tmp_path=tmp_path)
    api.restart("dyad-llm-0")
    api.delete("dyad-llm-1")
    eventually(lambda: dead_ranks(launcher) == [("llm", 2), ("llm", 3)])
    reason = dict(launcher.dead())[WorkerSpec("llm", 2)]
    assert reason == "(pod dyad-llm-1) was deleted and created again"
