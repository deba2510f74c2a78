"""Each LLM rank's peak GPU memory over a few real training steps of a dp2 layout, with the
optimizer sharded over the two replicas (`train.shard_optimizer`, the default) and replicated,
against `dyad plan`'s estimate of that rank (`dyad/app/dry_run.py`, the same function).

Two processes share the one GPU (a rank per process, as a run's workers are; NCCL refuses two
ranks on one GPU, so the pool's process group is gloo, which stages CUDA tensors through host
memory for its collectives). Each process runs the LLM pool's real worker (`LLMWorker`: its
parallelized model, optimizer, gradient reduction, step and update), commanded as the router
commands it, step by step from the router's `StepPlanner`; the encoder is played by a loopback
transport in the same process that sends each transfer's rows from host memory and takes their
gradients back there, so that only the LLM rank's own tensors are on the GPU. The model is a
~0.6 B-parameter MoE (four layers of sixteen 1,408-wide experts, top 4) in bfloat16 compute
from float32 weights, 256-token images in microbatches of four samples: its weights, gradients,
optimizer state and autocast's bf16 copies dominate the peak (an estimated 9 and 11 GiB a rank,
sharded and replicated), its activations a few percent of it.

Per rank and variant: the peak of `torch.cuda.max_memory_allocated` over the steps (and the
allocator's peak reservation), the memory held between steps (weights and optimizer state once
AdamW has stepped), the estimate's terms for the step with the largest one, and measured /
estimated for both; and what one microbatch's forward pass keeps for the backward pass (the
bf16 casts and the activations) against the estimate's casts and activations of its tokens
(data-parallel variants). Per variant, each step's loss (summed over the ranks' parts: the
pipeline's last stage holds all of it), and its largest relative difference from the first
variant's: every variant trains the same samples from the same weights, in bf16 compute.

    python bench/memory_plan.py --out $OUT/memory_plan.json
    python bench/memory_plan.py --toy --out /tmp/memory_plan.json   # CPU, tiny (CI): estimates only
    python bench/memory_plan.py --against docs/results/memory_h200/memory_plan.json  # today's estimate, no run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from run_info import bench_device, run_header, write_json  # beside this script

from dyad import config as config_lib
from dyad.app.dry_run import TERMS, rank_memories
from dyad.data import make_dataset
from dyad.data.batch import collate
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import microbatch_loss
from dyad.llm_service.worker import LLMWorker, planned_image_tokens
from dyad.router import estimate
from dyad.router.steps import StepPlanner, step_command
from dyad.service import boundary_dtype, compute_context
from dyad.transport import Direction, LoopbackTransport, MessageTag, Phase
from dyad.wire import pb

GIB = 2**30
SECRET = b"memory-plan-bench-secret"
RUN_ID = "memory-plan"
GENERATION = 1
TIMEOUT_S = 600  # a variant's two ranks

COMMON = ["parallel.llm.dp=2", "train.dtype=bfloat16", "train.microbatches=2", "checkpoint.interval_steps=0"]
GPU = [
    *COMMON,
    "train.device=cuda",
    "train.global_batch=16",  # 4 samples in each of 2 microbatches per rank
    "data.image_size=64",  # the encoder's 4-pixel patches: 256 image tokens a sample
    "llm.dim=2048",
    "llm.n_layers=4",
    "llm.n_heads=16",
    "llm.n_kv_heads=4",
    "llm.head_dim=128",
    "llm.dense_layers=[]",
    "llm.max_seq_len=512",
    "llm.moe.num_experts=16",
    "llm.moe.top_k=4",
    "llm.moe.expert_dim=1408",
]
TOY = [*COMMON, "train.device=cpu", "train.global_batch=8", "llm.n_layers=4"]
# Two pipeline stages of two layers each (no replica: nothing to shard), four microbatches of the
# data-parallel variants' four samples each, in 1F1B and in the interleaved schedule (two chunks of
# one layer a rank): the pipeline's activations and gradients cross between the two processes
# through host memory (`dyad.parallel.pipeline`, over gloo).
PIPELINE = ["parallel.llm.dp=1", "parallel.llm.pp=2", "train.microbatches=4", "boundary.prefetch_depth=4"]
VARIANTS = {
    "sharded": ["train.shard_optimizer=true"],
    "replicated": ["train.shard_optimizer=false"],
    "pp2": PIPELINE,
    "pp2-interleaved": [*PIPELINE, "parallel.llm.pp_virtual=2"],
}


def resolved(overrides: list[str]):
    config = config_lib.load(None, overrides)
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def estimates(config, dataset, steps: int) -> dict[int, dict]:
    """Per LLM rank, `dyad plan`'s estimate for the step (of the first `steps`) where it is
    largest: its terms and total, in bytes."""
    planner = StepPlanner(config, dataset)
    largest: dict[int, dict] = {}
    for step in range(steps):
        spec = planner.next(step)
        for rank in rank_memories(config, dataset, planner.image_tokens, spec, planner.boundary_plan(spec)):
            if rank.pool == "llm" and rank.memory.total > largest.get(rank.rank, {}).get("total", -1):
                largest[rank.rank] = {**dataclasses.asdict(rank.memory), "total": rank.memory.total, "step": step}
    return largest


class PlayedEncoder:
    """The encoder's side of one LLM rank's boundary, in host memory: each step's rows sent, and
    the buffers their gradients come back to, posted before the LLM rank's step. Every row is the
    same constant vector, so that every variant's LLM sees the same inputs whichever rank they go
    to."""

    def __init__(self, llm_rank: int, dtype: torch.dtype):
        self.transport = LoopbackTransport()
        self.llm_rank, self.dtype = llm_rank, dtype
        self.pending = []

    def post(self, command: pb.StepCommand, llm_address: str) -> None:
        space = f"{RUN_ID}/{GENERATION}"
        for transfer in command.plan.transfers:
            if transfer.dst_rank != self.llm_rank:
                continue
            rows_ND = torch.full((transfer.rows, command.plan.hidden), 0.02, dtype=self.dtype)
            forward = MessageTag(space, command.step, transfer.microbatch, Direction.FORWARD, transfer.src_rank,
                                 Phase.TRAIN)
            back = MessageTag(space, command.step, transfer.microbatch, Direction.BACKWARD, self.llm_rank)
            self.pending.append(self.transport.send(llm_address, forward, rows_ND))
            self.pending.append(self.transport.recv(llm_address, back, torch.empty_like(rows_ND)))

    def wait(self) -> None:
        for future in self.pending:
            future.result(timeout=600)
        self.pending = []


def rank_body(rank: int, overrides: list[str], steps: int, address: str, results) -> None:
    config, dataset = resolved(overrides)
    cuda = config.train.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # both ranks on the one GPU
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)
    worker = LLMWorker(config, LoopbackTransport(), rank, RUN_ID)
    encoder = PlayedEncoder(rank, getattr(torch, config.train.dtype))
    encoder.transport.authorize(SECRET, {worker.transport.address})
    worker.run_secret = SECRET
    encoder_ranks = range(config.parallel.encoder.world_size)
    worker.setup(pb.SetupCommand(generation=GENERATION, peers=[
        pb.Peer(worker=pb.WorkerId(pool=pb.POOL_ENCODER, rank=r), data_address=encoder.transport.address)
        for r in encoder_ranks
    ]))
    planner = StepPlanner(config, dataset)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    built = torch.cuda.memory_allocated() if cuda else 0
    peaks, resting, losses, started = [], [], [], time.perf_counter()
    for step in range(steps):
        spec = planner.next(step)
        command = step_command(spec, planner.boundary_plan(spec))
        encoder.post(command, worker.transport.address)
        result = worker.step(command)
        losses.append(result.lm_loss_sum)  # this rank's part of the step's loss
        worker.apply(pb.ApplyCommand(step=step, grad_scale=1.0))
        encoder.wait()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            resting.append(torch.cuda.memory_allocated())
    kept, kept_estimate = forward_keeps(worker, command) if cuda and config.parallel.llm.pp == 1 else (0, 0)
    results.put({
        "rank": rank,
        "forward_keeps_bytes": kept,
        "forward_keeps_estimate_bytes": kept_estimate,
        "built_bytes": built,
        "peak_bytes_by_step": peaks,
        "resting_bytes_by_step": resting,
        "loss_part_by_step": losses,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else 0,
        "seconds": time.perf_counter() - started,
    })
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown, as tests/helpers/distributed.py does: a thread a torch.distributed
    # component leaves joinable can abort the process at exit, after its results were sent.
    os._exit(0)


def forward_keeps(worker: LLMWorker, command: pb.StepCommand) -> tuple[int, int]:
    """Bytes the forward pass of this rank's first microbatch of `command` keeps for the backward
    pass (autocast's bf16 casts and the activations; image rows drawn at random stand in for the
    encoder's), and the estimate's casts and activations of those tokens."""
    config, dataset = worker.config, worker.dataset
    microbatch = next(mb for mb in command.microbatches if mb.llm_dp_rank == worker.groups.index("dp"))
    batch = collate(dataset.tokenizer, [dataset.sample(s) for s in microbatch.sample_ids],
                    planned_image_tokens(command.plan, microbatch.index))
    local = shard_microbatch(batch, pad_id=dataset.tokenizer.pad_id, cp=1, cp_rank=0, tp=1).to(worker.device)
    rows_NlD = torch.randn(local.image_rows_Nl.numel(), config.llm.dim, device=worker.device,
                           dtype=boundary_dtype(config)).requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with compute_context(config):
        loss = microbatch_loss(worker.model, local, rows_NlD, global_target_tokens=command.global_target_tokens,
                               global_microbatches=command.global_microbatches)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del loss
    parts = estimate.llm_parts(config.llm, config.parallel.llm)
    activations = estimate.llm_activations(config.llm, config.parallel.llm, batch.input_ids.numel(),
                                           element_size=estimate.ELEMENT_SIZE[config.train.dtype], recompute=False)
    return kept, activations + estimate.weight_casts(parts)


def measure(overrides: list[str], steps: int) -> dict[int, dict]:
    """Both ranks' measurements: two processes, spawned (CUDA does not survive a fork)."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    processes = [context.Process(target=rank_body, args=(rank, overrides, steps, address, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(TIMEOUT_S)
    for process in processes:
        if process.is_alive():  # its peer failed, and it waits in a collective
            process.kill()
            process.join()
    if any(process.exitcode for process in processes):
        raise SystemExit(f"a rank failed: exit codes {[process.exitcode for process in processes]}")
    measured = [results.get() for _ in processes]
    return {entry["rank"]: entry for entry in measured}


def compare(estimate: dict, measured: dict, cuda: bool) -> dict:
    """One rank's estimate against its measurements: the peak against the estimate's total; what
    stays between steps against its weights and optimizer state (AdamW's moments exist from
    the first update on, so from the second step's end)."""
    entry = {"estimate_gib": {term: estimate[term] / GIB for term in (*TERMS, "total")},
             "estimate_step": estimate["step"], "seconds": measured["seconds"]}
    if not cuda:
        return entry
    peak, resting = max(measured["peak_bytes_by_step"]), measured["resting_bytes_by_step"][-1]
    held = estimate["weights"] + estimate["optimizer"]
    return {
        **entry,
        "peak_allocated_gib": peak / GIB,
        "peak_reserved_gib": measured["peak_reserved_bytes"] / GIB,
        "peak_allocated_gib_by_step": [b / GIB for b in measured["peak_bytes_by_step"]],
        "allocated_after_build_gib": measured["built_bytes"] / GIB,
        "allocated_between_steps_gib": resting / GIB,
        "peak_over_estimate": peak / estimate["total"],
        "between_steps_over_weights_and_optimizer": resting / held,
        "forward_keeps_gib": measured["forward_keeps_bytes"] / GIB,
        "forward_keeps_estimate_gib": measured["forward_keeps_estimate_bytes"] / GIB,
    }


def estimate_against(path: str, out: str | None) -> None:
    """The current estimate (`dyad plan`'s) of every variant and rank of an earlier GPU run,
    against the peaks measured there: for an estimate changed since the run."""
    with open(path) as f:
        measured = json.load(f)
    results = {"measured": path, "variants": {}}
    for name, variant in measured["variants"].items():
        config, dataset = resolved([*measured["overrides"], *VARIANTS[name]])
        expected = estimates(config, dataset, measured["steps"])
        ranks = {}
        for rank, entry in variant["ranks"].items():
            total = expected[int(rank)]["total"] / GIB
            ranks[rank] = {"estimate_gib": total, "peak_allocated_gib": entry["peak_allocated_gib"],
                           "peak_over_estimate": entry["peak_allocated_gib"] / total}
            print(f"{name:>15} llm rank {rank}: estimate {total:.2f} GiB, measured peak "
                  f"{entry['peak_allocated_gib']:.2f} GiB (x{ranks[rank]['peak_over_estimate']:.3f})", flush=True)
        results["variants"][name] = {"ranks": ranks}
    write_json(out, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--toy", action="store_true", help="CPU, a tiny model: estimates only")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant (the peak needs AdamW's moments: 2+)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--against", metavar="JSON",
                        help="no run: today's estimate of each variant of a GPU run's JSON against its measured peaks")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.against:
        return estimate_against(args.against, args.out)
    device = bench_device(args.toy)
    results = {**run_header(device), "steps": args.steps, "overrides": [*(TOY if args.toy else GPU), *args.set],
               "variants": {}}
    for name in args.variants:
        overrides = [*results["overrides"], *VARIANTS[name]]
        config, dataset = resolved(overrides)
        expected = estimates(config, dataset, args.steps)
        measured = measure(overrides, args.steps)
        ranks = {rank: compare(expected[rank], measured[rank], device == "cuda") for rank in sorted(measured)}
        loss = [sum(parts) for parts in zip(*(measured[rank]["loss_part_by_step"] for rank in measured))]
        first = next(iter(results["variants"].values()), {"loss_by_step": loss})["loss_by_step"]
        apart = max(abs(a - b) / abs(b) for a, b in zip(loss, first))
        results["variants"][name] = {"ranks": ranks, "loss_by_step": loss, "loss_apart_from_first_variant": apart}
        print(f"{name:>10} loss by step {[round(x, 5) for x in loss]} (relative difference from the first variant "
              f"{apart:.2e})", flush=True)
        for rank, entry in ranks.items():
            line = f"{name:>10} llm rank {rank}: estimate {entry['estimate_gib']['total']:.2f} GiB"
            if device == "cuda":
                line += (f", peak allocated {entry['peak_allocated_gib']:.2f} GiB (x{entry['peak_over_estimate']:.3f}); "
                         f"between steps {entry['allocated_between_steps_gib']:.2f} GiB "
                         f"(x{entry['between_steps_over_weights_and_optimizer']:.3f} of weights + optimizer)")
            print(line, flush=True)
        write_json(args.out, results)


if __name__ == "__main__":
    main()
