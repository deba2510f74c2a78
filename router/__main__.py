"""Run the router: `python -m dyad.router --host 127.0.0.1 --port 50051`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from dyad.router.server import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dyad.router")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", help="write the bound host:port here once serving")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("DYAD_LOG_LEVEL", "INFO"),
        format="%(asctime)s router %(levelname)s %(message)s",
    )
    server, state = serve(args.host, args.port)
    logging.info("router serving on %s", state.address)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(state.address)
        os.replace(tmp, args.port_file)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    for run_id in state.active_run_ids():
        state.get(run_id).stop_requested.set()
    state.wait_idle(30)
    server.stop(grace=2).wait()


if __name__ == "__main__":
    main()
