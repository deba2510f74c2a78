"""Expert parallelism on one host's GPUs: dyad's all-to-all token dispatcher against NCCL's own
all_to_all_single moving the same bytes between the same ranks, and the MoE layer's forward +
backward, at each ep.

    NCCL_NVLS_ENABLE=0 python bench/ep_alltoall.py --out $OUT/ep_alltoall.json   # ep 4 and 8
    python bench/ep_alltoall.py --ep 2 4 --timeline-dir $OUT/timelines          # four GPUs, profiled
    python bench/ep_alltoall.py --toy                                           # CPU, gloo, ep 2 (CI)

One process per GPU (gloo on CPU with --toy). For each ep, the LLM pool's own layout object
(`LLMLayout(dp=world, ep=ep)`, edp = world / ep replicas of the experts) builds the process
groups (`ProcessGroups`), `parallelize_moe` shards a `MoELayer` over them with the all-to-all
dispatcher, and each rank feeds it its own tokens. Per token count:
- layer: forward + backward of the parallelized layer (router, dispatch, experts, combine);
- dispatch / combine: the dispatcher's own `dispatch` and `combine` (no autograd), standalone,
  on the routing the layer's router chose for those tokens;
- reference: `dist.all_to_all_single` with the same split sizes (the same bytes to the same ranks),
  each direction, into preallocated buffers: the wire alone.
Bandwidth counts the bytes each rank sends to other ranks (its own rows stay), averaged over the
ranks, over the slowest rank's median time. Every timing starts from a barrier with the devices
idle. Prints a table; writes JSON. With `--timeline-dir`, every rank then profiles three of each
(layer steps, dispatches, combines) and writes their kernels, the gaps between them and the host
ops (`bench/kernel_timeline.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kernel_timeline import write_timeline  # beside this script
from moe_layer import expert_flops

from dyad.layout import LLMLayout
from dyad.llm_service.config import MoEConfig
from dyad.llm_service.expert_parallel import DISPATCHERS, parallelize_moe
from dyad.llm_service.moe import MoELayer
from dyad.parallel.groups import ProcessGroups
from dyad.router.launcher import free_ports

# The MoE layer of bench/e2e_8gpu.py's LLM: 56 experts, so that ep 2, 4, 7 and 8 all divide them.
GPU_SHAPE = {
    "dim": 2048,
    "experts": 56,
    "top_k": 4,
    "expert_dim": 1408,
    "tokens": [4096, 16384],
}
TOY_SHAPE = {"dim": 64, "experts": 8, "top_k": 2, "expert_dim": 32, "tokens": [256]}
WARMUP = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_s(fn, iters: int, device: torch.device) -> float:
    """This rank's median seconds of `fn`, every run started together from a barrier."""
    times = []
    for _ in range(WARMUP + iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def over_ranks(value: float, op, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def expert_parallel_layer(shape: dict, groups: ProcessGroups, device, dtype) -> MoELayer:
    """The same full layer on every rank (seeded), sharded over ep, then moved to the device."""
    torch.manual_seed(0)
    cfg = MoEConfig(
        num_experts=shape["experts"],
        top_k=shape["top_k"],
        expert_dim=shape["expert_dim"],
        aux_loss_coef=0.01,
        dispatcher="alltoall",
    )
    layer = MoELayer(shape["dim"], cfg)
    parallelize_moe(
        layer,
        ep_group=groups.group("ep"),
        etp_group=groups.group("etp"),
        dispatcher="alltoall",
    )
    return layer.to(device, dtype)


def layer_step(layer: MoELayer, x_TD: torch.Tensor):
    """The layer's forward + backward on `x_TD`, as a function of no arguments."""
    x_TD = x_TD.detach().requires_grad_()
    grad_TD = torch.randn_like(x_TD)

    def step():
        y_TD, aux = layer(x_TD)
        torch.autograd.backward([y_TD, aux], [grad_TD, torch.ones_like(aux)])

    return step


def remote_bytes(splits: list[int], me: int, row_bytes: int) -> int:
    return (sum(splits) - splits[me]) * row_bytes


def dispatcher_calls(layer: MoELayer, groups: ProcessGroups, x_TD: torch.Tensor):
    """The dispatcher, its dispatch and combine as functions of no arguments (on the routing the
    layer's router chose for `x_TD`), and the handle of one dispatch."""
    dispatcher = DISPATCHERS["alltoall"](groups.group("ep"), layer.cfg.num_experts, groups.group("etp"))
    _, gates_TK, expert_idx_TK = layer.route(x_TD)
    x_local_MD, _, handle = dispatcher.dispatch(x_TD, expert_idx_TK)
    return (
        lambda: dispatcher.dispatch(x_TD, expert_idx_TK),
        lambda: dispatcher.combine(x_local_MD, gates_TK, handle),
        handle,
    )


@torch.no_grad()
def time_dispatcher(layer: MoELayer, groups: ProcessGroups, x_TD: torch.Tensor, iters: int) -> dict:
    """The dispatcher's dispatch and combine, and all_to_all_single of the same splits, each way."""
    ep_group, device = groups.group("ep"), x_TD.device
    dispatch, combine, handle = dispatcher_calls(layer, groups, x_TD)
    send_ND = x_TD.new_empty(sum(handle.send_splits), x_TD.shape[1])
    recv_ND = x_TD.new_empty(sum(handle.recv_splits), x_TD.shape[1])
    send, recv = handle.send_splits, handle.recv_splits
    row_bytes, me = x_TD.shape[1] * x_TD.element_size(), dist.get_rank(ep_group)
    return {
        "dispatch_s": median_s(dispatch, iters, device),
        "combine_s": median_s(combine, iters, device),
        "reference_dispatch_s": median_s(
            lambda: dist.all_to_all_single(recv_ND, send_ND, recv, send, group=ep_group),
            iters,
            device,
        ),
        "reference_combine_s": median_s(
            lambda: dist.all_to_all_single(send_ND, recv_ND, send, recv, group=ep_group),
            iters,
            device,
        ),
        "dispatch_bytes": remote_bytes(send, me, row_bytes),
        "combine_bytes": remote_bytes(recv, me, row_bytes),
    }


def write_timelines(layer: MoELayer, groups: ProcessGroups, x_TD: torch.Tensor, prefix: str) -> None:
    """Every rank: the kernels and host ops of three layer steps, dispatches and combines
    (`bench/kernel_timeline.py`), to `{prefix}_{layer,dispatch,combine}_rank{r}.txt`."""
    with torch.no_grad():
        dispatch, combine, _ = dispatcher_calls(layer, groups, x_TD)
    for name, call in (("layer", layer_step(layer, x_TD)), ("dispatch", dispatch), ("combine", combine)):
        dist.barrier()
        with torch.set_grad_enabled(name == "layer"):
            write_timeline(call, f"{prefix}_{name}_rank{dist.get_rank()}.txt", host_ops=120)


def measure(shape: dict, ep: int, world: int, iters: int, device, dtype, timeline_dir: str | None = None) -> dict:
    """One row per token count: every time is the slowest rank's median, bytes the ranks' mean."""
    groups = ProcessGroups.build(LLMLayout(dp=world, ep=ep))
    layer = expert_parallel_layer(shape, groups, device, dtype)
    rows = {}
    for tokens in shape["tokens"]:
        torch.manual_seed(1000 + dist.get_rank())
        x_TD = torch.randn(tokens, shape["dim"], device=device, dtype=dtype)
        layer_s = median_s(layer_step(layer, x_TD), iters, device)
        local = {"layer_s": layer_s} | time_dispatcher(layer, groups, x_TD, iters)
        row = {key: over_ranks(value, dist.ReduceOp.MAX, device) for key, value in local.items() if key.endswith("_s")}
        for direction in ("dispatch", "combine"):
            mean_bytes = over_ranks(local[f"{direction}_bytes"], dist.ReduceOp.SUM, device) / world
            row[f"{direction}_MB"] = mean_bytes / 1e6
            for timed in (direction, f"reference_{direction}"):
                row[f"{timed}_GBps"] = mean_bytes / row[f"{timed}_s"] / 1e9
        row["layer_expert_tflops"] = expert_flops(shape["dim"], shape["expert_dim"], tokens, shape["top_k"]) / (
            row["layer_s"] * 1e12
        )
        rows[tokens] = row
        if timeline_dir and device.type == "cuda":
            write_timelines(layer, groups, x_TD, f"{timeline_dir}/timeline_ep{ep}_{tokens}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _worker(rank: int, world: int, port: int, shape: dict, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.toy:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        device, dtype = torch.device("cuda", rank), torch.bfloat16
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    for ep in args.ep:
        rows = measure(shape, ep, world, args.iters, device, dtype, args.timeline_dir)
        if rank == 0:
            results[ep] = rows
    dist.destroy_process_group()


def print_table(results: dict, label: str) -> None:
    print(
        f"{'ep':>3s} {'tokens':>7s} {'layer ms':>9s} {'MB out':>8s} "
        f"{'dispatch GB/s':>14s} {label + ' GB/s':>10s} {'combine GB/s':>13s} {label + ' GB/s':>10s}"
    )
    for ep, rows in sorted(results.items()):
        for tokens, r in sorted(rows.items()):
            print(
                f"{ep:3d} {tokens:7d} {r['layer_s'] * 1e3:9.2f} {r['dispatch_MB']:8.1f} "
                f"{r['dispatch_GBps']:14.1f} {r['reference_dispatch_GBps']:10.1f} "
                f"{r['combine_GBps']:13.1f} {r['reference_combine_GBps']:10.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="CPU: 2 ranks, gloo, ep 2")
    parser.add_argument("--ep", type=int, nargs="+", default=[4, 8], help="up to the GPUs")
    parser.add_argument("--tokens", type=int, nargs="+", help="per rank")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--timeline-dir", help="GPU: every rank writes its layer, dispatch and combine timelines here")
    args = parser.parse_args()
    if args.timeline_dir:
        os.makedirs(args.timeline_dir, exist_ok=True)
    world = 2 if args.toy else torch.cuda.device_count()
    args.ep = [2] if args.toy else [ep for ep in args.ep if ep <= world]
    if not args.ep:
        raise SystemExit(f"no ep degree fits this host's {world} GPU(s) (or use --toy)")
    shape = TOY_SHAPE if args.toy else GPU_SHAPE | {"tokens": args.tokens or GPU_SHAPE["tokens"]}
    # NVLink multicast stays off on the lent hosts (spawned ranks inherit the environment).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            _worker,
            args=(world, free_ports(1)[0], shape, args, results),
            nprocs=world,
            join=True,
        )
        results = dict(results)
    print_table(results, "gloo" if args.toy else "NCCL")
    if args.out:
        info = {
            "device": "cpu" if args.toy else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "world": world,
            "shape": shape,
            "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
            "ep": results,
        }
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
