"""A fake Kubernetes API server (stdlib HTTP in a thread) that answers the calls the router's
KubernetesLauncher makes the way the API server does: the scale subresource, pod list and watch
(chunked JSON lines, resourceVersions, timeoutSeconds, 410 Gone for compacted history), plus a
StatefulSet controller's part (pods created from the template, and deleted, with the replicas).
It authorizes like the API server with the router's Role (tests/helpers/k8s_manifests.py ROUTER_RULES,
which the manifests' Role must equal): anything else is 403 Forbidden and recorded in
`forbidden`.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from tests.helpers.k8s_manifests import ROUTER_RULES

NS = "ns"
SELECTOR = "app.kubernetes.io/name=dyad,app.kubernetes.io/component in (encoder,llm)"
_RESOURCE_PATH = re.compile(
    r"/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/[^/]+/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<subresource>[^/]+))?)?"
)


def authorization(method: str, path: str, query: dict) -> tuple[str, str, str] | None:
    """(API group, resource, verb) of a request, as the API server's RBAC sees it."""
    m = _RESOURCE_PATH.fullmatch(path)
    if not m:
        return None
    resource = m["resource"] + (f"/{m['subresource']}" if m["subresource"] else "")
    if method == "GET":
        watch = query.get("watch", "").lower() == "true"  # Go's ParseBool takes True too
        verb = "get" if m["name"] else "watch" if watch else "list"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or (
            "delete" if m["name"] else "deletecollection"
        )
    return (m["group"] or "", resource, verb)


def statefulset_manifest(name: str, env: dict[str, str], gpus: int | None) -> dict:
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "1"},
        "spec": {
            "replicas": 0, "serviceName": name,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "dyad"}},
            "template": {"spec": {"containers": [{
                "name": "worker", "image": "dyad:test",
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "resources": resources,
            }]}},
        },
    }


class FakeApiServer:
    """The API server's state (pods with an event history) and its HTTP face."""

    def __init__(self):
        self.cond = threading.Condition()
        self.version = 100
        self.history: list[tuple[int, str, dict]] = []  # (resourceVersion, type, pod)
        self.compacted = 0  # watches from a version at or below this get 410 Gone
        self.gone_as_status = False  # answer such a watch with HTTP 410, not an ERROR event
        self.expiries = 0  # bumped: open watches send an ERROR 410 event and end
        self.drops = 0  # bumped: open watches lose their connection mid-event
        self.closing = False
        self.pods: dict[str, dict] = {}
        self.statefulsets = {
            "dyad-encoder": statefulset_manifest("dyad-encoder", {}, gpus=None),
            "dyad-llm": statefulset_manifest("dyad-llm", {"DYAD_GPUS_PER_POD": "2"}, gpus=2),
        }
        self.requests: list[dict] = []
        self.forbidden: list[dict] = []  # requests outside the router's Role
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def calls(self, method: str, path: str) -> list[dict]:
        with self.cond:
            return [r for r in self.requests if r["method"] == method and r["path"] == path]

    # ------------------------------------------------------------------ the cluster's side

    def _record(self, kind: str, pod: dict, silently: bool = False) -> None:
        self.version += 1
        pod["metadata"]["resourceVersion"] = str(self.version)
        if not silently:
            self.history.append((self.version, kind, json.loads(json.dumps(pod))))
        self.cond.notify_all()

    def _create_pod(self, name: str, silently: bool = False) -> None:
        pool = name.split("-")[1]
        template = self.statefulsets[name.rpartition("-")[0]]["spec"]["template"]
        self.pods[name] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": NS, "uid": str(uuid.uuid4()),
                "labels": {"app.kubernetes.io/name": "dyad", "app.kubernetes.io/component": pool},
            },
            "spec": json.loads(json.dumps(template["spec"])),
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{
                    "name": "worker", "image": "dyad:test", "imageID": "sha256:0",
                    "ready": True, "restartCount": 0,
                    "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                }],
            },
        }
        self._record("ADDED", self.pods[name], silently)

    def _delete_pod(self, name: str, silently: bool = False) -> dict:
        pod = self.pods.pop(name)
        self._record("DELETED", pod, silently)
        return pod

    def _control(self, name: str, silently: bool = False) -> None:
        """The StatefulSet controller: one pod per ordinal below replicas."""
        replicas = self.statefulsets[name]["spec"]["replicas"]
        for pod in sorted(p for p in self.pods if p.rpartition("-")[0] == name):
            if int(pod.rpartition("-")[2]) >= replicas:
                self._delete_pod(pod, silently)
        for ordinal in range(replicas):
            if f"{name}-{ordinal}" not in self.pods:
                self._create_pod(f"{name}-{ordinal}", silently)

    def change(self, name: str, silently: bool = False, **status) -> None:
        """Set a pod's worker-container fields (restartCount, state) or its phase."""
        with self.cond:
            pod = self.pods[name]
            if "phase" in status:
                pod["status"]["phase"] = status.pop("phase")
            pod["status"]["containerStatuses"][0].update(status)
            self._record("MODIFIED", pod, silently)

    def restart(self, name: str, silently: bool = False) -> None:
        """The kubelet restarted the pod's container: its workers had exited."""
        container = self.pods[name]["status"]["containerStatuses"][0]
        self.change(
            name, silently, restartCount=container["restartCount"] + 1,
            state={"running": {"startedAt": "2026-01-01T00:01:00Z"}},
            lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        )

    def exit(self, name: str) -> None:
        """The pod's container exited; the kubelet restarts it after a back-off."""
        self.change(name, state={"terminated": {"exitCode": 0, "reason": "Completed"}})

    def delete(self, name: str) -> None:
        """Someone (a node drain, a person) deleted the pod; the controller recreates it."""
        with self.cond:
            self._delete_pod(name)
            self._control(name.rpartition("-")[0])

    def expire(self, change=None) -> None:
        """History compacted: `change()` happens while no watch sees it, and open watches
        get an ERROR 410 event."""
        with self.cond:
            if change:
                change()
            self.compacted = self.version
            self.expiries += 1
            self.cond.notify_all()

    def drop(self, compact: bool = False) -> None:
        """Open watch connections break in the middle of an event."""
        with self.cond:
            self.drops += 1
            if compact:
                self.compacted = self.version
            self.cond.notify_all()


def _handler(api: FakeApiServer):
    scale_path = re.compile(r"/apis/apps/v1/namespaces/([^/]+)/statefulsets/([^/]+)/scale")
    pods_path = re.compile(r"/api/v1/namespaces/([^/]+)/pods")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _request(self):
            """The request's (path, query, body), or None when RBAC refused it (answered)."""
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            request = {
                "method": self.command, "path": url.path, "query": query, "body": body,
                "content_type": self.headers.get("Content-Type"),
                "authorization": self.headers.get("Authorization"),
            }
            with api.cond:
                api.requests.append(request)
            rule = authorization(self.command, url.path, query)
            if rule not in ROUTER_RULES:
                with api.cond:
                    api.forbidden.append(request)
                group, resource, verb = rule or ("", url.path, self.command.lower())
                self._json(403, {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Forbidden", "code": 403,
                    "message": f'User "system:serviceaccount:{NS}:dyad-router" cannot {verb} '
                               f'resource "{resource}" in API group "{group}" in the namespace',
                })
                return None
            return url.path, query, body

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _not_found(self, what: str, name: str) -> None:
            self._json(404, {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                "message": f'{what} "{name}" not found', "code": 404,
            })

        def _scale(self, name: str) -> dict:
            replicas = api.statefulsets[name]["spec"]["replicas"]
            return {
                "apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": replicas}, "status": {"replicas": replicas},
            }

        def do_GET(self):
            if (request := self._request()) is None:
                return
            path, query, _ = request
            if m := scale_path.fullmatch(path):
                with api.cond:
                    if m[2] not in api.statefulsets:
                        return self._not_found("statefulsets.apps", m[2])
                    return self._json(200, self._scale(m[2]))
            if pods_path.fullmatch(path):
                assert query.get("labelSelector") == SELECTOR, query
                if authorization("GET", path, query)[2] == "watch":
                    return self._watch(int(query["resourceVersion"]), int(query["timeoutSeconds"]))
                with api.cond:
                    return self._json(200, {
                        "apiVersion": "v1", "kind": "PodList",
                        "metadata": {"resourceVersion": str(api.version)},
                        "items": [api.pods[name] for name in sorted(api.pods)],
                    })
            self._not_found("path", path)

        def do_PATCH(self):
            if (request := self._request()) is None:
                return
            path, _, body = request
            m = scale_path.fullmatch(path)
            with api.cond:
                if not m or m[2] not in api.statefulsets:
                    return self._not_found("statefulsets.apps", path)
                api.statefulsets[m[2]]["spec"]["replicas"] = body["spec"]["replicas"]
                api._control(m[2])
                return self._json(200, self._scale(m[2]))

        def do_DELETE(self):  # the Role allows no other method: 403 before anything else
            if self._request() is not None:
                self._not_found("path", self.path)

        do_POST = do_PUT = do_DELETE

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _watch(self, since: int, timeout_s: int) -> None:
            with api.cond:
                expiries, drops = api.expiries, api.drops
                gone = since <= api.compacted
                if gone and api.gone_as_status:
                    return self._json(410, {
                        "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Expired", "message": "too old resource version", "code": 410,
                    })
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            deadline = time.monotonic() + timeout_s
            while not gone:
                with api.cond:
                    api.cond.wait_for(
                        lambda since=since: api.closing or api.expiries != expiries
                        or api.drops != drops or api.history[-1:] and api.history[-1][0] > since,
                        timeout=max(0.0, deadline - time.monotonic()),
                    )
                    events = [e for e in api.history if e[0] > since]
                    dropped, gone = api.drops != drops, api.expiries != expiries
                    ended = api.closing or time.monotonic() >= deadline
                for version, kind, pod in events:
                    self._chunk(json.dumps({"type": kind, "object": pod}).encode() + b"\n")
                    since = version
                if dropped:  # half an event, then the connection is gone
                    self.wfile.write(b"60\r\n{\"type\": \"MODIFIED\", \"obj")
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if ended:
                    break
            if gone:
                self._chunk(json.dumps({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                    "message": "too old resource version", "code": 410,
                }}).encode() + b"\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler
