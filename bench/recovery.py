"""What a worker's death costs a run: one worker is SIGKILLed mid-step and the router recovers
from the last committed checkpoint. Reports when the router noticed, how long the restart's
phases took (stopping the old workers, starting and registering the new ones, setting them up
and restoring), and how long until the run was back at the step it had reached.

    NCCL_NVLS_ENABLE=0 python bench/recovery.py --out $OUT/recovery.json --work $OUT/runs
    python bench/recovery.py --kill llm/0 --set router.abort_grace_s=10   # A/B: the stop's grace
    python bench/recovery.py --toy       # CPU, tiny, gloo (CI)

The job: bench/e2e_hetero.py's vit-l-224 workload on two GPUs, both pools data-parallel over
both (dp2: rank r of each pool on GPU r), so the killed rank's peers are left mid-step waiting
for it (on two H200s one waited until it was ended; on CPUs gloo and UCX notice the closed
connection within about a second), checkpoints every
`--interval` steps (a checkpoint holds the steps before it: steps 0-3 for the one of step 4). The
kill comes when step `--kill-after` is reported, while the next step is in flight: the steps
after the last checkpoint are trained again. That checkpoint must be committed by then (else the
script stops): the workers sync its files as they save (`checkpoint.sync_in_background=false`
here), since with the default, background sync a recovery that began while they were syncing
would wait for them (measured on two H200s: 16-18 s of the recovery, a kill two steps of 0.33 s
after a checkpoint of about 36 GB; `--set checkpoint.sync_in_background=true` with a later
`--kill-after` measures that default).

Measured on this side, from the kill (arrival times of the run's events):
- noticed: the router's recovery notice (it has found the dead worker and is about to restart);
- back: step `--kill-after` reported again, i.e. the run is where it was when the worker died;
- lost: back, less the steps trained again (the router's own times for them): the time no step
  ran; in steps: lost / the steady step time (median over the steps before the kill);
- the restart's phases as the router timed them (its log's "generation N started in" line).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

from e2e_hetero import DP2, TOY, VIT_L_224, microbatches, run_arguments, with_compile, write_results

from dyad import config as config_lib
from dyad.app.client import RouterClient, local_router
from dyad.wire import as_dict, pb

RECOVERY = [*VIT_L_224, *DP2, microbatches(16, 2)]
TOY_POOLS = ["parallel.encoder.dp=1", "parallel.llm.dp=2", "train.microbatches=2"]
_GENERATION_STARTED = re.compile(r"generation (\d+) started in (.*)")


@dataclasses.dataclass
class Timeline:
    steps: list[tuple[float, dict]]  # every step event in arrival order: (s since start, metrics)
    notices: list[dict]
    killed_s: float | None
    info: pb.RunInfo


def worker_pid(log_dir: Path, pool: str, rank: int) -> int:
    """The local worker process of `pool` rank: the one writing its log (`log_dir`/POOL-RANK.log:
    a fresh process's command line, or a forked one's, says nothing of its rank)."""
    log = (log_dir / f"{pool}-{rank}.log").resolve()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if Path(os.readlink(proc / "fd" / "1")) == log:
                return int(proc.name)
        except OSError:
            continue
    raise RuntimeError(f"no worker process writes {log}")


def follow_with_kill(client: RouterClient, run_id: str, kill_after: int, victim: tuple[str, int],
                     log_dir: Path) -> Timeline:
    """Follow the run; once step `kill_after` is reported (the first time) and a checkpoint has
    been committed, SIGKILL `victim`: the recovery then waits for no checkpoint's background sync
    (a kill while one is syncing waits for it, since the run goes back to that checkpoint)."""
    start = time.perf_counter()
    steps, notices, killed_s, info = [], [], None, None
    for event in client.watch(run_id):
        now = time.perf_counter() - start
        kind = event.WhichOneof("event")
        if kind == "step":
            steps.append((now, as_dict(event.step)))
            committed = any(n["kind"] == "checkpoint" for n in notices)
            if event.step.step == kill_after and killed_s is None:
                if not committed:
                    raise SystemExit(f"step {kill_after} came before a checkpoint was committed: raise --kill-after")
                os.kill(worker_pid(log_dir, *victim), signal.SIGKILL)
                killed_s = time.perf_counter() - start
        elif kind == "notice":
            notices.append({"t_s": now, "kind": event.notice.kind, "step": event.notice.step,
                            "message": event.notice.message})
        else:
            info = event.finished
    return Timeline(steps, notices, killed_s, info or client.get_run(run_id))


def recovery_cost(timeline: Timeline, kill_after: int, skip: int) -> dict:
    """When the router noticed, when the run was back, and the time lost (module docstring)."""
    killed = timeline.killed_s
    noticed = min(n["t_s"] for n in timeline.notices if n["kind"] == "recovery")
    before = [m for t, m in timeline.steps if t < killed]
    again = [(t, m) for t, m in timeline.steps if t > noticed]
    back_s = next(t for t, m in again if m["step"] == kill_after)
    redone_s = sum(m["step_time_s"] for t, m in again if t <= back_s)
    steady_s = statistics.median(m["step_time_s"] for m in before[skip:] or before)
    lost_s = back_s - killed - redone_s
    return {
        "noticed_s": noticed - killed,
        "back_s": back_s - killed,
        "steps_redone": sum(1 for t, _ in again if t <= back_s),
        "redone_s": redone_s,
        "lost_s": lost_s,
        "steady_step_s": steady_s,
        "steps_lost": lost_s / steady_s,
    }


def restart_phases(router_log: Path, generation: int) -> str:
    """The router's timing of the restart into `generation`, as it logged it."""
    for line in reversed(router_log.read_text().splitlines()):
        found = _GENERATION_STARTED.search(line)
        if found and int(found.group(1)) == generation:
            return found.group(2)
    return "not logged"


def main() -> None:
    parser = run_arguments(steps=12, skip=1)
    parser.add_argument("--kill", default="llm/1", help="POOL/RANK of the worker to SIGKILL")
    parser.add_argument("--kill-after", type=int, default=5, help="kill once this step (from 0) is reported")
    parser.add_argument("--interval", type=int, default=4, help="checkpoint.interval_steps")
    args = parser.parse_args()
    pool, _, rank = args.kill.partition("/")
    if pool not in ("encoder", "llm") or not rank.isdigit():
        raise SystemExit(f"--kill: POOL/RANK such as llm/1, got {args.kill!r}")
    if args.toy:
        args.steps, args.kill_after, args.interval = 6, 2, 2
    if not args.interval <= args.kill_after < args.steps - 1:
        raise SystemExit("--kill-after must come after the first checkpoint (--interval) and before the last step")
    if (args.kill_after + 1) % args.interval == 0:
        raise SystemExit(f"--kill-after {args.kill_after}: the kill would land in the checkpoint saved after that step")
    job = [*TOY, *TOY_POOLS] if args.toy else with_compile(RECOVERY, args)
    base = [*job, "checkpoint.sync_in_background=false", *args.set]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the router's workers inherit it
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-recovery-"))
    overrides = [f"checkpoint.interval_steps={args.interval}", f"train.steps={args.steps}", "router.max_recoveries=1"]
    config = config_lib.load(None, [*base, *overrides])
    if int(rank) >= getattr(config.parallel, pool).world_size:
        raise SystemExit(f"--kill: {pool} has {getattr(config.parallel, pool).world_size} rank(s), no rank {rank}")
    config = dataclasses.replace(config, out_dir=str((work / "recovery").resolve()))
    router_log = work / "recovery" / "logs" / "router.log"
    with local_router(router_log) as client:
        run_id = client.start_run(config_lib.to_yaml(config)).run_id
        timeline = follow_with_kill(client, run_id, args.kill_after, (pool, int(rank)), router_log.parent)
    info = timeline.info
    if info.state != pb.RUN_STATE_SUCCEEDED or info.recoveries != 1 or timeline.killed_s is None:
        result = {"error": f"state {info.state}, {info.recoveries} recoveries: {info.message}"}
        print(f"FAILED: {result['error'][:1000]}")
    else:
        result = recovery_cost(timeline, args.kill_after, args.skip) | {"restart": restart_phases(router_log, info.generation)}
        print(
            f"{args.kill} killed after step {args.kill_after}: noticed in {result['noticed_s']:.1f} s; "
            f"restart {result['restart']}; back at step {args.kill_after} {result['back_s']:.1f} s after "
            f"the kill ({result['steps_redone']} steps trained again, {result['redone_s']:.1f} s): "
            f"{result['lost_s']:.1f} s lost, {result['steps_lost']:.1f} steps of {result['steady_step_s']:.3f} s"
        )
    if args.out:
        write_results(args.out, args.toy, base, killed=args.kill, kill_after=args.kill_after,
                      interval=args.interval, notices=timeline.notices, **result)
    if "error" in result:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
