"""A router that dies having sent a step's command to the LLM pool only: the LLM worker then
waits for image rows that never come, as after a real router's death between its sends.

Loaded into a router process by `router_death_site/sitecustomize.py` when
$DYAD_TEST_ROUTER_DIES_AT_STEP names the step."""

from __future__ import annotations

import os
import time

STEP_ENV = "DYAD_TEST_ROUTER_DIES_AT_STEP"
SITE = os.path.join(os.path.dirname(__file__), "router_death_site")
_FLUSH_S = 1.0  # for the gRPC server to write the command to the LLM worker's stream


def environment(env: dict[str, str], step: int) -> dict[str, str]:
    """`env` for a router process that dies at `step`."""
    return env | {STEP_ENV: str(step), "PYTHONPATH": os.pathsep.join(filter(None, [SITE, env.get("PYTHONPATH")]))}


def from_environment() -> None:
    if STEP_ENV not in os.environ:
        return
    from dyad.router.run import Run

    dies_at = int(os.environ[STEP_ENV])
    send = Run.send

    def send_then_die(run, command, pools=None):
        if command.WhichOneof("command") != "step" or command.step.step != dies_at:
            return send(run, command, pools)
        everyone = run.registered
        run.registered = lambda pools=None: {k: c for k, c in everyone(pools).items() if k[0] == "llm"}
        send(run, command, pools)  # numbered and kept for all pools, queued for the LLM's only
        llm = run.registered()
        while not all(channel.commands.empty() for channel in llm.values()):
            time.sleep(0.01)
        time.sleep(_FLUSH_S)
        os._exit(9)

    Run.send = send_then_die
