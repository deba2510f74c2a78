"""Resizing the pools during a run: the encoder pool takes over GPUs the LLM pool gives up (issue 8:
encoder 2 -> 3 GPUs, LLM 6 -> 5), through the router's ScalePool at a step boundary. Reports the
steady throughput before, the resize's cost, and the steady throughput after.

    NCCL_NVLS_ENABLE=0 python bench/resize.py --out $OUT/resize.json --work $OUT/runs
    python bench/resize.py --pools 1+3   # four GPUs: encoder 1 -> 2, LLM 3 -> 2
    python bench/resize.py --pools 1+2 --devices 0,1/1,0   # two GPUs, each shared by a rank of each pool
    python bench/resize.py --config $OUT/workload/workload.yaml --move 2   # encoder 2 -> 4, LLM 6 -> 4
    python bench/resize.py --toy         # CPU: encoder 1 -> 2 ranks, LLM 2 -> 1 (CI)

How a GPU changes pools. ScalePool resizes one pool's data-parallel degree (`dyad.config.scaled`:
every other degree stays, the step keeps its global batch and microbatches); requests are
applied at the next step boundary, all pending ones together: a checkpoint is committed, the
changed pools are stopped and started at their new sizes, and they restore from it. The router
never edits the device lists (`parallel.*_devices`: rank r on devices[r % len]). So this script
names the moving GPU in both lists from the start: encoder [0, 1, 7] (two ranks use GPUs 0 and 1),
LLM [2, ..., 7]; after the resize the encoder's third rank runs on GPU 7 and the LLM's five on
GPUs 2-6. It asks the LLM pool to shrink first and the encoder pool to grow second, back to back:
both land during the same step and are applied in one restart; should they fall on two step
boundaries, the GPU is free before the encoder takes it (the JSON counts the restarts).

`--config` resizes another job (bench/native_moe_workload.py's, say: its LLM needs ep 2, which
divides 6 and 4 but not 5, so `--move 2`: encoder 2 -> 4, LLM 6 -> 4).

Why this LLM: `scaled` keeps ep, and ep must divide the LLM pool at both sizes (6 and 5): only
ep=1 does. So the LLM is bench/e2e_hetero.py's (2.9 B parameters, 16 experts), which fits one
GPU without expert parallelism, with bench/e2e_8gpu.py's larger encoder; the step's LLM
microbatches of four samples split evenly over both sizes of the LLM pool: 30 (120 samples)
for 6 and 5 ranks, 30 for 3 and 2 (`gpu_pools`).

Measured, from the run's step events (arrival times on this side) and the router's step times:
- before / after: medians over the steady steps (e2e_hetero's `summarize`);
- pause: wall time from the requests to the end of the first step after the resize, less the
  router-measured time of the steps trained in that interval: the time no step ran (checkpoint,
  stopping and starting the pools, restoring);
- warm-up: what the first `--skip` steps after the resize took beyond the steady step after it;
- cost = pause + warm-up; steps lost = cost / the steady step time after the resize.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

from e2e_8gpu import LARGER_ENCODER, parse_pool  # beside this script
from e2e_hetero import TOY, VIT_L_224, run_arguments, summarize, with_compile, write_results

from dyad import config as config_lib
from dyad.app.client import RouterClient, local_router
from dyad.data import make_dataset
from dyad.wire import as_dict, pb

RESIZE = [*VIT_L_224, *LARGER_ENCODER]
SAMPLES_PER_MICROBATCH = 4
MIN_MICROBATCHES = 30  # a step's LLM microbatches, at least
TOY_POOLS = {"encoder": 1, "llm": 2, "move": 1, "microbatches": 1, "global_batch": 8}


def gpu_pools(split: str, move: int = 1) -> dict:
    """'2+6' -> the encoder pool on 2 GPUs, the LLM pool on 6, `move` GPUs moving from the LLM to
    the encoder; the step's LLM microbatches a multiple of both LLM sizes, at least
    MIN_MICROBATCHES."""
    pools = parse_pool(split)
    if pools is None or move < 1 or pools[1] <= move:
        raise SystemExit(f"--pools: E+L with E >= 1 encoder GPUs and L > --move ({move}) LLM GPUs, got {split!r}")
    encoder, llm = pools
    both = math.lcm(llm, llm - move)
    total = both * math.ceil(MIN_MICROBATCHES / both)
    return {
        "encoder": encoder,
        "llm": llm,
        "move": move,
        "microbatches": total // llm,
        "global_batch": total * SAMPLES_PER_MICROBATCH,
    }


GPU_POOLS = gpu_pools("2+6")


def device_lists(encoder: int, llm: int, move: int) -> tuple[list[int], list[int]]:
    """The encoder pool on the first GPUs, the LLM pool on the next; the LLM's last `move` GPUs
    also end the encoder's list, where the encoder's new ranks land once it grows."""
    llm_devices = list(range(encoder, encoder + llm))
    return list(range(encoder)) + llm_devices[llm - move :], llm_devices


def parse_devices(text: str) -> tuple[list[int], list[int]]:
    """'0,1/1,0' -> the encoder's and the LLM's GPU lists."""
    try:
        encoder, llm = (tuple(int(gpu) for gpu in part.split(",")) for part in text.split("/"))
    except ValueError:
        raise SystemExit(f"--devices: ENCODER_GPUS/LLM_GPUS such as 0,1/1,0, got {text!r}") from None
    return list(encoder), list(llm)


def pool_overrides(pools: dict, devices: tuple[list[int], list[int]]) -> list[str]:
    encoder_devices, llm_devices = devices
    return [
        f"parallel.encoder.dp={pools['encoder']}",
        f"parallel.llm.dp={pools['llm']}",
        f"train.microbatches={pools['microbatches']}",
        f"train.global_batch={pools['global_batch']}",
        f"parallel.encoder_devices={encoder_devices}",
        f"parallel.llm_devices={llm_devices}",
    ]


def scale_requests(pools: dict) -> list[tuple[str, int]]:
    """The LLM pool shrinks first, so its GPU is free before the encoder pool grows onto it."""
    return [
        ("llm", pools["llm"] - pools["move"]),
        ("encoder", pools["encoder"] + pools["move"]),
    ]


@dataclasses.dataclass
class Timeline:
    steps: dict[int, tuple[float, dict]]  # step -> (arrival s, its metrics)
    notices: list[dict]
    requested_s: float | None
    info: pb.RunInfo


def follow_with_resize(client: RouterClient, run_id: str, resize_after: int, requests) -> Timeline:
    """Follow the run; once step `resize_after` is done, send the scale requests."""
    start = time.perf_counter()
    steps, notices, requested_s, info = {}, [], None, None
    for event in client.watch(run_id):
        now = time.perf_counter() - start
        kind = event.WhichOneof("event")
        if kind == "step":
            steps[event.step.step] = (now, as_dict(event.step))
            if event.step.step == resize_after and requested_s is None:
                for pool, replicas in requests:
                    client.scale_pool(run_id, pool, replicas)
                requested_s = time.perf_counter() - start
        elif kind == "notice":
            notices.append(
                {
                    "t_s": now,
                    "kind": event.notice.kind,
                    "step": event.notice.step,
                    "message": event.notice.message,
                }
            )
        else:
            info = event.finished
    return Timeline(steps, notices, requested_s, info or client.get_run(run_id))


def first_step_after_resize(timeline: Timeline) -> int | None:
    resized_s = max(n["t_s"] for n in timeline.notices if n["kind"] == "resize")
    after = [step for step, (arrived, _) in timeline.steps.items() if arrived > resized_s]
    return min(after, default=None)


def resize_cost(
    timeline: Timeline,
    resize_after: int,
    first_after: int,
    after_step_s: float,
    skip: int,
) -> dict:
    """The pause and the warm-up (see the module's docstring), their sum in seconds and in steps."""
    step_s = {step: m["step_time_s"] for step, (_, m) in timeline.steps.items()}
    request_to_first_step_s = timeline.steps[first_after][0] - timeline.requested_s
    trained_s = sum(step_s[step] for step in range(resize_after + 1, first_after + 1))
    pause_s = request_to_first_step_s - trained_s
    warmup_s = sum(step_s[step] - after_step_s for step in range(first_after, first_after + skip))
    return {
        "first_step_after": first_after,
        "request_to_first_step_s": request_to_first_step_s,
        "pause_s": pause_s,
        "warmup_s": warmup_s,
        "cost_s": pause_s + warmup_s,
        "steps_lost": (pause_s + warmup_s) / after_step_s,
    }


def measure(config, timeline: Timeline, args, gpus: int) -> dict:
    restarts = [n for n in timeline.notices if n["kind"] == "resize"]
    first_after = first_step_after_resize(timeline) if restarts else None
    records = [m for _, (_, m) in sorted(timeline.steps.items())]
    after = [m for m in records if first_after is not None and m["step"] >= first_after + args.skip]
    info = timeline.info
    if info.state != pb.RUN_STATE_SUCCEEDED or info.recoveries or not after:
        return {
            "error": f"state {info.state}, {len(restarts)} resize(s), {info.recoveries} recoveries, "
            f"{len(after)} steady steps after the resize: {info.message}"
        }
    before = [m for m in records if args.skip <= m["step"] <= args.resize_after]
    after_summary = summarize(config, after, gpus, 0)
    cost = resize_cost(timeline, args.resize_after, first_after, after_summary["step_s"], args.skip)
    return {
        "before": summarize(config, before, gpus, 0),
        "after": after_summary,
        "resize": cost | {"restarts": len(restarts)},
        "final_pools": {"encoder": info.encoder_replicas, "llm": info.llm_replicas},
    }


def print_result(result: dict, pools: dict, notices: list[dict]) -> None:
    if "error" in result:
        print(f"FAILED: {result['error'][:1000]}")
        return
    before, after, cost = result["before"], result["after"], result["resize"]
    print(
        f"encoder {pools['encoder']} -> {pools['encoder'] + pools['move']}, "
        f"llm {pools['llm']} -> {pools['llm'] - pools['move']} ({cost['restarts']} restart(s))"
    )
    for name, r in (("before", before), ("after", after)):
        print(
            f"{name:7s} {r['step_s']:7.3f} s/step {r['tokens_per_s']:9.0f} tokens/s "
            f"{r['tflops_per_gpu']:7.1f} TFLOP/s per GPU"
        )
    for notice in notices:
        if notice["kind"] == "resize":  # the restart's phases, as the router timed them
            print(f"restart: {notice['message']}")
    print(
        f"resize: {cost['request_to_first_step_s']:.1f} s from the request to the first step after, "
        f"pause {cost['pause_s']:.1f} s + warm-up {cost['warmup_s']:.1f} s = {cost['steps_lost']:.1f} steps lost"
    )


def main() -> None:
    parser = run_arguments(steps=18, skip=2)  # skip: at the start and after the resize
    parser.add_argument("--resize-after", type=int, default=7, help="request after this step")
    parser.add_argument("--config", help="a run config file to resize instead of the ViT job above (e.g. "
                        "bench/native_moe_workload.py's workload.yaml); its layouts but the pools' dp stay")
    parser.add_argument("--pools", default="2+6", help="E+L: encoder and LLM GPUs before the resize")
    parser.add_argument("--move", type=int, default=1, help="GPUs moving from the LLM pool to the encoder pool "
                        "(the LLM's ep must divide both its sizes: 2 for an ep 2 LLM of 6 GPUs)")
    parser.add_argument("--devices", help="ENCODER/LLM GPU lists (rank r on list[r %% len]) instead of "
                        "one GPU a rank, e.g. 0,1/1,0 for --pools 1+2 on two GPUs")
    args = parser.parse_args()
    workload = [] if args.config else RESIZE
    base, pools = (TOY, TOY_POOLS) if args.toy else (with_compile(workload, args), gpu_pools(args.pools, args.move))
    base = [*base, *args.set]
    if args.toy:
        args.steps, args.resize_after, args.skip = 7, 2, 1
    # Steady steps before: skip..resize_after; after: the one in flight, the first after the
    # resize, `skip` warm-up steps, then at least two.
    if args.resize_after < args.skip or args.steps < args.resize_after + args.skip + 4:
        raise SystemExit("--steps / --resize-after / --skip leave no steady steps to measure")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the router's workers inherit it
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-resize-"))
    devices = parse_devices(args.devices) if args.devices else device_lists(pools["encoder"], pools["llm"], pools["move"])
    config = config_lib.load(args.config, [*base, *pool_overrides(pools, devices), f"train.steps={args.steps}"])
    config = dataclasses.replace(config, out_dir=str((work / "resize").resolve()))
    resolved = config_lib.resolve(config, vocab_size=make_dataset(config.data).tokenizer.vocab_size)
    for pool, replicas in scale_requests(pools):  # refuse here what the router would
        config_lib.scaled(resolved, pool, replicas)
    with local_router(work / "resize" / "logs" / "router.log") as client:
        run_id = client.start_run(config_lib.to_yaml(config)).run_id
        timeline = follow_with_resize(client, run_id, args.resize_after, scale_requests(pools))
    result = measure(config, timeline, args, gpus=len(set(devices[0]) | set(devices[1])))
    print_result(result, pools, timeline.notices)
    if args.out:
        write_results(
            args.out,
            args.toy,
            base,
            pools=pools,
            devices={"encoder": devices[0], "llm": devices[1]},
            notices=timeline.notices,
            **result,
        )


if __name__ == "__main__":
    main()
