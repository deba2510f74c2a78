"""The Kubernetes launcher: each pool is a StatefulSet (`dyad-encoder`, `dyad-llm`) with a
headless Service of the same name, and every pod runs DYAD_GPUS_PER_POD (N) workers, ranks
`ordinal*N .. ordinal*N + N-1` (dyad/app/pod.py).

The router only sets each StatefulSet's replicas (through its scale subresource) and watches the
pods: its Role allows nothing else (k8s/base/rbac.yaml). It learns N from its own environment,
`DYAD_ENCODER_GPUS_PER_POD` and `DYAD_LLM_GPUS_PER_POD` (the manifests set them to the pools'
`nvidia.com/gpu`), not from the StatefulSets, and checks it against each pod's own
DYAD_GPUS_PER_POD as the watch shows the pods. The StatefulSet creates the pods; the kubelet
restarts a pod's container whenever its workers exit, which is how a worker the router told to
stop comes back for the next generation. A worker that does not stop (stuck in a collective, or
frozen) is never deleted by the router: it exits by itself once the router has released it for
router.abort_grace_s (a recovery) or router.stop_grace_s (dyad/app/worker.py), or its pod's
supervisor stops it when it goes silent (dyad/app/pod.py); its container restarts like any other.
A container restart the router did not ask for, or a pod deleted, replaced or failed, is a dead
worker.

Pods are followed with the API's list-then-watch protocol: list, watch from the list's
resourceVersion; on 410 Gone (the server no longer has that history) list again; when the stream
ends (its timeout) or breaks (a dropped connection), watch again from the last resourceVersion
seen. Pod objects are read as plain JSON: the client's models are not needed for five fields.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from http import HTTPStatus

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from dyad.pools import pool_names
from dyad.router.launcher import Launcher, WorkerSpec

log = logging.getLogger(__name__)

RENDEZVOUS_PORT = 29500
POD_SELECTOR = "app.kubernetes.io/name=dyad,app.kubernetes.io/component in (encoder,llm)"
_COMPONENT_LABEL = "app.kubernetes.io/component"
_FIRST_LIST_TIMEOUT_S = 30.0


def statefulset(pool: str) -> str:
    return f"dyad-{pool}"


def gpus_per_pod_env(pool: str) -> str:
    return f"DYAD_{pool.upper()}_GPUS_PER_POD"


def gpus_per_pod_from_env(environ: Mapping[str, str]) -> dict[str, int]:
    """Workers per pod of each pool, from the router's environment (k8s/base/router.yaml)."""
    per_pod = {}
    for pool in pool_names():
        name = gpus_per_pod_env(pool)
        value = environ.get(name, "")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"${name} must be a whole number >= 1 (the nvidia.com/gpu limit of the {pool} "
                f"pool's pods) for --launcher kubernetes, got {value!r}"
            )
        per_pod[pool] = int(value)
    return per_pod


class KubernetesError(RuntimeError):
    """A Kubernetes API call failed: what was asked, and the API server's status and reason."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class PodState:
    """What the watch knows of one pool pod; the worker container is the pod's first."""

    pool: str
    uid: str
    phase: str
    ready: bool
    restarts: int  # the worker container's restartCount
    running: bool  # its container is running now
    exited: bool  # its container exited and waits to be restarted (restartCount grows then)
    last_exit: str  # how its container last ended, e.g. "OOMKilled (exit code 137)"
    deleted: bool  # deleted, or being deleted
    workers: int | None = None  # its DYAD_GPUS_PER_POD (1 if unset); None: not a plain value

    @classmethod
    def of(cls, pod: dict, deleted: bool = False) -> PodState:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        worker_spec = ((pod.get("spec") or {}).get("containers") or [{}])[0]
        worker = worker_spec.get("name")
        env = {e.get("name"): e for e in worker_spec.get("env") or []}
        workers = env.get("DYAD_GPUS_PER_POD", {"value": "1"}).get("value")
        container = next(
            (c for c in status.get("containerStatuses") or [] if c.get("name") == worker), {}
        )
        state, last = container.get("state") or {}, container.get("lastState") or {}
        ended = state.get("terminated") or last.get("terminated") or {}
        return cls(
            pool=(meta.get("labels") or {}).get(_COMPONENT_LABEL, ""),
            uid=meta.get("uid", ""),
            phase=status.get("phase", "Pending"),
            ready=any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or []
            ),
            restarts=container.get("restartCount", 0),
            running=state.get("running") is not None,
            exited=state.get("terminated") is not None
            or (state.get("waiting") is not None and last.get("terminated") is not None),
            last_exit=f"{ended.get('reason', 'exited')} (exit code {ended.get('exitCode')})"
            if ended else "",
            deleted=deleted or bool(meta.get("deletionTimestamp")),
            workers=int(workers) if workers is not None and workers.isdigit() else None,
        )


@dataclass
class _Expected:
    """A pod the router expects to keep running: which one (its uid; None until the
    StatefulSet has created it, then the first one seen that is not `retired`) and its
    container's restart count meanwhile."""

    pool: str
    ordinal: int
    uid: str | None
    restarts: int
    retired: str = ""  # the uid of the pod it replaces, which may still show for a while


class KubernetesLauncher(Launcher):
    def __init__(
        self,
        namespace: str = "default",
        api_client: client.ApiClient | None = None,
        *,
        gpus_per_pod: Mapping[str, int],
        max_workers: int = Launcher.max_workers,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
        backoff_s: tuple[float, float] = (0.5, 30.0),
    ):
        """`gpus_per_pod`: workers per pod of each pool (`gpus_per_pod_from_env`). Without
        `api_client`: the pod's service account, else the kubeconfig ($KUBECONFIG, read now)."""
        if set(gpus_per_pod) != set(pool_names()) or min(gpus_per_pod.values()) < 1:
            raise ValueError(f"gpus_per_pod must give each of {pool_names()} >= 1, got {gpus_per_pod}")
        if api_client is None:
            configuration = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                config.load_kube_config(
                    os.environ.get("KUBECONFIG"), client_configuration=configuration
                )
            api_client = client.ApiClient(configuration)
        self.namespace = namespace
        self.max_workers = max_workers  # the cluster's share for dyad: set by `dyad router --max-workers`
        self._core = client.CoreV1Api(api_client)
        self._apps = client.AppsV1Api(api_client)
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff_s = backoff_s
        self._cond = threading.Condition()
        self._pods: dict[str, PodState] = {}  # pod name -> state, from the watch
        self._expected: dict[str, _Expected] = {}  # pods whose workers must keep running
        self._stopped: dict[str, _Expected] = {}  # pods told to stop: their next life
        self._per_pod = dict(gpus_per_pod)
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._listed = threading.Event()
        self._list_error = ""
        self._response = None
        self._version: str | None = None  # where the pod watch goes on from

    # ------------------------------------------------------------------ Launcher

    def rendezvous(self, pools: Iterable[str]) -> dict[str, str]:
        """Rank 0 of a pool runs on the StatefulSet's pod 0, named by its headless Service."""
        return {
            pool: f"{_pod(pool, 0)}.{statefulset(pool)}.{self.namespace}.svc:{RENDEZVOUS_PORT}"
            for pool in pools
        }

    def start(self, run_id, router_address, workers, log_dir, env=None) -> None:
        """Scale each pool's StatefulSet to hold `workers`' ranks. The pods' manifest, not this
        call, gives them the router's address and the join token."""
        self._ensure_watching()
        replicas = {}
        for pool in sorted({spec.pool for spec in workers}):
            size = 1 + max(spec.rank for spec in workers if spec.pool == pool)
            per_pod = self._per_pod[pool]
            if size % per_pod:
                raise ValueError(
                    f"the {pool} pool has {size} ranks, not a multiple of the {per_pod} workers "
                    f"per pod of statefulset {statefulset(pool)} (${gpus_per_pod_env(pool)})"
                )
            replicas[pool] = size // per_pod
        for pool, count in replicas.items():
            self.scale(pool, count)
            with self._cond:
                for name in [n for n, e in self._expected.items() if e.pool == pool]:
                    del self._expected[name]
                for ordinal in range(count):
                    self._expected[_pod(pool, ordinal)] = self._expectation(pool, ordinal)

    def dead(self) -> list[tuple[WorkerSpec, str]]:
        """Workers lost; ValueError when a pod runs another number of workers than the router
        counts on (its ranks would be wrong: no recovery can mend that)."""
        found = []
        with self._cond:
            for name, expected in self._expected.items():
                pod, per_pod = self._pods.get(name), self._per_pod[expected.pool]
                if pod is not None and not pod.deleted and pod.workers not in (None, per_pod):
                    raise ValueError(
                        f"pod {name} runs {pod.workers} workers (its DYAD_GPUS_PER_POD) but the "
                        f"router's ${gpus_per_pod_env(expected.pool)} is {per_pod}: set both to "
                        f"the pod's nvidia.com/gpu limit (and delete pods of an older template)"
                    )
                reason = _lost(pod, expected)
                if reason:
                    first = expected.ordinal * per_pod
                    found += [
                        (WorkerSpec(expected.pool, rank), f"(pod {name}) {reason}")
                        for rank in range(first, first + per_pod)
                    ]
        return found

    def stop(self, pools: Iterable[str] | None = None, timeout_s: float = 10.0) -> None:
        """The workers of `pools` were told to stop, so their pods' containers exit and restart:
        wait up to `timeout_s` for that. A container that has not exited by then restarts later
        (its workers exit once released for the grace the new generation gave them, or its
        supervisor stops them; the next generation waits for them to register); nothing is
        deleted. `pools=None`, the end of the run: scale every pool to 0 and stop watching."""
        if pools is None:
            self._end()
            return
        pools = set(pools)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            for name in [n for n, e in self._expected.items() if e.pool in pools]:
                del self._expected[name]
            before = {n: p for n, p in self._pods.items() if p.pool in pools and not p.deleted}
            while True:
                hung = [n for n, p in before.items() if not _exited(self._pods.get(n), p)]
                left = deadline - time.monotonic()
                if not hung or left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            for name, pod in before.items():  # how each will look when its workers run again:
                # its container restarted once more (or restarting), unless it never ran
                restarts = pod.restarts + (1 if pod.running or pod.exited else 0)
                self._stopped[name] = _Expected(pod.pool, _ordinal(name), pod.uid, restarts)
        if hung:  # one line for the pools, however many pods
            log.warning(
                "%d pod(s) (%s): their workers did not exit within %gs of being told to stop; they "
                "exit once released for router.stop_grace_s, or their supervisor stops them when "
                "they are silent (dyad/app/worker.py, dyad/app/pod.py), and their containers restart",
                len(hung), ", ".join(sorted(hung)), timeout_s,
            )

    def adopt(self, spec: WorkerSpec, pid: int) -> None:
        """Nothing to do: a pid means nothing outside its pod, and the pods outlive routers."""

    def pods(self) -> dict[str, PodState]:
        """The pool pods as the watch knows them (deleted ones too)."""
        with self._cond:
            return dict(self._pods)

    def close(self) -> None:
        """Stop watching (the thread ends with its current request)."""
        self._closing.set()
        response = self._response
        if response is not None and hasattr(response, "shutdown"):  # urllib3 >= 2.3
            response.shutdown()

    # ------------------------------------------------------------------ API calls

    def scale(self, pool: str, replicas: int) -> None:
        name = statefulset(pool)
        scale = self._call(
            f"read the scale of statefulset {name}",
            self._apps.read_namespaced_stateful_set_scale, name, self.namespace,
        )
        current = (scale.get("spec") or {}).get("replicas", 0)
        if current == replicas:
            return
        log.info("statefulset %s/%s: replicas %d -> %d", self.namespace, name, current, replicas)
        self._call(
            f"scale statefulset {name} to {replicas}",
            self._apps.patch_namespaced_stateful_set_scale, name, self.namespace,
            {"spec": {"replicas": replicas}},  # sent as a strategic merge patch
        )

    def _call(self, action: str, method, *args, **kwargs) -> dict:
        """One API call's JSON answer, or KubernetesError saying what failed and why."""
        try:
            response = method(
                *args, _preload_content=False, _request_timeout=self._request_timeout_s, **kwargs
            )
        except ApiException as error:
            raise KubernetesError(
                f"{action} in namespace {self.namespace}: {_describe(error)}", error.status
            ) from error
        except urllib3.exceptions.HTTPError as error:
            raise KubernetesError(f"{action} in namespace {self.namespace}: {error}") from error
        return json.loads(response.data or b"{}")

    def _end(self) -> None:
        with self._cond:
            self._expected.clear()
            self._stopped.clear()
        for pool in pool_names():
            try:
                self.scale(pool, 0)
            except KubernetesError as error:  # the run is over either way: say what is left
                log.error("could not scale the %s pool to 0 at the end of the run: %s", pool, error)
        self.close()

    def _expectation(self, pool: str, ordinal: int) -> _Expected:
        """How the pod must look while its workers run (called under the lock)."""
        name = _pod(pool, ordinal)
        pod = self._pods.get(name)
        stopped = self._stopped.pop(name, None)
        if stopped is not None:
            if stopped.uid is None or pod is not None and pod.uid == stopped.uid:
                return stopped
            return _Expected(pool, ordinal, None, 0, stopped.uid)  # replaced while it stopped
        if pod is None or pod.deleted:  # the StatefulSet creates a new one
            return _Expected(pool, ordinal, None, 0, pod.uid if pod else "")
        return _Expected(pool, ordinal, pod.uid, pod.restarts + (1 if pod.exited else 0))

    # ------------------------------------------------------------------ the pod watch

    def _ensure_watching(self) -> None:
        """Follow the pods from a thread (one at a time); the first list must succeed."""
        if self._watcher is not None and self._closing.is_set():
            self._watcher.join()  # closed: it ends with its current request
        if self._watcher is None or not self._watcher.is_alive():
            self._closing.clear()
            self._listed.clear()
            self._list_error = ""
            self._watcher = threading.Thread(
                target=self._follow_pods, name=f"k8s-pods-{self.namespace}", daemon=True
            )
            self._watcher.start()
        action = f"list pods in namespace {self.namespace}"
        if not self._listed.wait(_FIRST_LIST_TIMEOUT_S):
            raise KubernetesError(f"{action}: no answer within {_FIRST_LIST_TIMEOUT_S:g}s")
        if self._list_error:
            raise KubernetesError(f"{action}: {self._list_error}")

    def _follow_pods(self) -> None:
        self._version, delay = None, self._backoff_s[0]
        while not self._closing.is_set():
            try:
                if self._version is None:
                    self._list()
                self._follow()
            except ApiException as error:
                if error.status == HTTPStatus.GONE:
                    log.info(
                        "pod watch: resourceVersion %s expired (410 Gone); listing again",
                        self._version,
                    )
                    self._version = None
                    continue
                problem = _describe(error)
            # dropped, reset, timed out; or a garbled answer (bad JSON, no resourceVersion)
            except (urllib3.exceptions.HTTPError, OSError, ValueError, KeyError) as error:
                problem = f"{type(error).__name__}: {error}"
            else:
                delay = self._backoff_s[0]  # the server ended the stream: watch on
                continue
            if self._closing.is_set():
                return
            if not self._listed.is_set():
                self._list_error = problem
                self._listed.set()
            log.warning(
                "pod watch in namespace %s: %s; watching again from resourceVersion %s in %.1fs",
                self.namespace, problem, self._version, delay,
            )
            self._closing.wait(delay)
            delay = min(2 * delay, self._backoff_s[1])

    def _list(self) -> None:
        """Replace what is known of the pods by a fresh list, and watch from its version."""
        response = self._core.list_namespaced_pod(
            self.namespace, label_selector=POD_SELECTOR,
            _preload_content=False, _request_timeout=self._request_timeout_s,
        )
        body = json.loads(response.data)
        pods = {p["metadata"]["name"]: PodState.of(p) for p in body.get("items") or []}
        with self._cond:
            for name, old in self._pods.items():  # gone while nobody watched
                pods.setdefault(name, replace(old, deleted=True))
            self._pods = pods
            self._cond.notify_all()
        self._version = body["metadata"]["resourceVersion"]
        self._list_error = ""
        self._listed.set()

    def _follow(self) -> None:
        """Apply watch events after `self._version` (moving it on) until the stream ends."""
        response = self._core.list_namespaced_pod(
            self.namespace, label_selector=POD_SELECTOR, watch=True,
            resource_version=self._version, allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout_s, _preload_content=False,
            # the server ends the stream after timeout_seconds; a silent one is a dead connection
            _request_timeout=(self._request_timeout_s, self._watch_timeout_s + 30),
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if self._closing.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, pod = event["type"], event["object"]
                if kind == "ERROR":  # a Status, e.g. 410 Expired when the history is compacted
                    raise ApiException(
                        status=pod.get("code"), reason=f"{pod.get('reason')}: {pod.get('message')}"
                    )
                self._version = pod["metadata"]["resourceVersion"]
                if kind == "BOOKMARK":
                    continue
                with self._cond:
                    name = pod["metadata"]["name"]
                    self._pods[name] = PodState.of(pod, deleted=kind == "DELETED")
                    self._cond.notify_all()
        finally:
            self._response = None
            response.close()
            response.release_conn()


def _exited(pod: PodState | None, before: PodState) -> bool:
    """Whether the pod's workers, running as `before`, are gone."""
    return (
        pod is None or pod.deleted or pod.uid != before.uid
        or pod.restarts > before.restarts or not pod.running
    )


def _lost(pod: PodState | None, expected: _Expected) -> str:
    """Why the workers of a pod expected to run are gone, or "" (called under the lock)."""
    if pod is None:
        return ""  # not created yet
    if expected.uid is None:
        if pod.deleted or pod.uid == expected.retired:
            return ""  # the previous pod of that name, going away
        expected.uid = pod.uid
    if pod.uid != expected.uid:
        return "was deleted and created again"
    if pod.deleted:
        return "was deleted"
    if pod.phase == "Failed":
        return "failed"
    if pod.restarts > expected.restarts:
        ended = f"; it ended: {pod.last_exit}" if pod.last_exit else ""
        return f"container restarted (restartCount {expected.restarts} -> {pod.restarts}){ended}"
    return ""


def _pod(pool: str, ordinal: int) -> str:
    return f"{statefulset(pool)}-{ordinal}"


def _ordinal(pod_name: str) -> int:
    return int(pod_name.rpartition("-")[2])


def _describe(error: ApiException) -> str:
    """"403 Forbidden: <the API server's message>"."""
    text = f"{error.status} {error.reason}"
    try:
        message = json.loads(error.body or "")["message"]
    except (ValueError, TypeError, KeyError):
        return text
    return f"{text}: {message}"
