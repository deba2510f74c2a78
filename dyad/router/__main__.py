"""Run the router: `python -m dyad.router --host 127.0.0.1 --port 50051`.

Tokens come from `--token-file`/`--join-token-file`, else $DYAD_TOKEN/$DYAD_JOIN_TOKEN; TLS from
`--tls-cert --tls-key` (and `--tls-client-ca` to require client certificates).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from dyad.credentials import CLIENT_TOKEN_ENV, JOIN_TOKEN_ENV, load_token
from dyad.router.auth import Credentials, server_credentials
from dyad.router.launcher import LocalLauncher
from dyad.router.streams import MAX_WATCHERS


def add_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound host:port here once serving")
    parser.add_argument("--token-file", help=f"the client token (default: ${CLIENT_TOKEN_ENV})")
    parser.add_argument(
        "--join-token-file", help=f"the workers' join token (default: ${JOIN_TOKEN_ENV})"
    )
    parser.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA")
    parser.add_argument("--state-db", help="SQLite file keeping run state across restarts")
    parser.add_argument(
        "--launcher", choices=("local", "kubernetes"), default="local",
        help="where workers run: processes on this machine, or the pools' StatefulSets",
    )
    parser.add_argument(
        "--namespace", default=os.environ.get("POD_NAMESPACE", "default"),
        help="the pools' namespace for --launcher kubernetes (default: $POD_NAMESPACE or default)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)"
    )
    parser.add_argument(
        "--max-workers", type=int, default=0,
        help="the most worker processes a run may have, all pools together (default: 4 per CPU "
        "and at least 16 for --launcher local, 1024 for kubernetes); larger runs and resizes are "
        "refused",
    )
    parser.add_argument(
        "--max-watchers", type=int, default=MAX_WATCHERS,
        help=f"WatchRun streams served at once; more get RESOURCE_EXHAUSTED (default {MAX_WATCHERS})",
    )
    parser.add_argument(
        "--stop-when-stdin-closes", action="store_true",
        help="stop, as on SIGTERM, when standard input ends: the process that started this router "
        "and holds the pipe's other end is gone, even killed (`dyad train`'s local router)",
    )


def run(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT (or, with --stop-when-stdin-closes, the end of standard
    input), then stop active runs."""
    from dyad.router.server import serve  # here: `dyad` imports this module for its flags

    credentials = Credentials(
        client_token=load_token(CLIENT_TOKEN_ENV, args.token_file),
        join_token=load_token(JOIN_TOKEN_ENV, args.join_token_file),
    )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = None
    if args.tls_cert:
        tls = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    # Local workers inherit this environment: they need the join token, never the client token.
    os.environ.pop(CLIENT_TOKEN_ENV, None)
    os.environ[JOIN_TOKEN_ENV] = credentials.join_token
    logging.basicConfig(
        level=os.environ.get("DYAD_LOG_LEVEL", "INFO"),
        format="%(asctime)s router %(levelname)s %(message)s",
    )
    if args.max_workers < 0:
        raise ValueError(f"--max-workers must be >= 1 (0: the launcher's default), got {args.max_workers}")
    limit = {"max_workers": args.max_workers} if args.max_workers else {}
    options = {"max_watchers": args.max_watchers}
    if args.launcher == "kubernetes":
        from dyad.router.k8s import KubernetesLauncher, gpus_per_pod_from_env

        per_pod = gpus_per_pod_from_env(os.environ)  # a missing one fails here, not in a run
        options["launcher_factory"] = lambda: KubernetesLauncher(
            args.namespace, gpus_per_pod=per_pod, **limit
        )
    else:
        options["launcher_factory"] = lambda: LocalLauncher(**limit)
    if args.metrics_port:
        from dyad.router.metrics import start_metrics_server

        options["observer"], _ = start_metrics_server(args.metrics_port, args.host)
    server, state = serve(
        args.host, args.port, credentials=credentials, tls=tls, state_db=args.state_db, **options
    )
    logging.info("router serving on %s (%s)", state.address, "TLS" if tls else "plaintext")
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(state.address)
        os.replace(tmp, args.port_file)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    if args.stop_when_stdin_closes:
        threading.Thread(target=_stop_at_end_of_stdin, args=(stopping,), daemon=True).start()
    stopping.wait()
    if args.state_db:
        # A router with a state store is restarted, not retired (a pod rescheduled, a rollout):
        # its active runs stay as they are, and the next router on this store resumes them.
        logging.info("leaving runs %s to the next router", state.active_run_ids() or "(none)")
    else:
        for run_id in state.active_run_ids():
            state.get(run_id).stop_requested.set()
        state.wait_idle(30)
    server.stop(grace=2).wait()


def _stop_at_end_of_stdin(stopping: threading.Event) -> None:
    """Read standard input to its end, which comes when every holder of the pipe's write end is
    gone, then stop: no run outlives the process that started this router."""
    # The file descriptor, not sys.stdin: a thread blocked in a buffered read holds the buffer's
    # lock, which the interpreter's shutdown then cannot take (a fatal error at every exit).
    while os.read(sys.stdin.fileno(), 4096):
        pass
    logging.info("standard input closed: whoever started this router is gone; stopping")
    stopping.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dyad.router")
    add_arguments(parser, default_port=0)
    try:
        run(parser.parse_args(argv))
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")


if __name__ == "__main__":
    main()
