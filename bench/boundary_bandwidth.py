"""Boundary transfer bandwidth, GPU to GPU: dyad's UCX transport (ucxx) against NCCL send/recv
on the same pair of devices, for boundary-sized messages.

    python bench/boundary_bandwidth.py --out $OUT/bandwidth.json      # 2 GPUs
    python bench/boundary_bandwidth.py --toy                         # CPU, small sizes (CI)

Two processes (rank 0 sends, rank 1 receives). Each size is timed on the receiver from a
barrier to the completed receive, median of `--iters`. A gloo group carries the barriers and the
UCX addresses. Prints a table (GB/s, and UCX as a fraction of NCCL); writes JSON.

`--windows 1 8 64` (the default) times each size three times: one message at a time, where a
fixed cost per message (about 0.15 ms in UCX itself on an H200, more through Python; see
`bench/ucx_message_cost.py`) is part of every number, and W = 8 and W = 64 messages in flight at
once (W buffers each side, all posted before any is waited on: `isend`/`irecv` for NCCL), as
bandwidth tests count it (OSU's osu_bw keeps a window of 64 messages in flight by default). The
first message's latency is spread over the W messages of a window, so the wider window says
what the transport sustains, the narrower one what a burst of eight gets.
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

MB = 1 << 20
GPU_SIZES_MB = [1, 4, 16, 64, 128, 256, 512]
TOY_SIZES_MB = [1, 4]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_nccl(rank, buffers, iters, device, group) -> float:
    times = []
    for _ in range(iters + 2):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        if rank == 0:
            works = [dist.isend(buffer, dst=1) for buffer in buffers]
        else:
            works = [dist.irecv(buffer, src=0) for buffer in buffers]
        for work in works:
            work.wait()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _time_ucx(rank, transport, peer, buffers, iters, device, group) -> float:
    from dyad.transport import Direction, MessageTag

    times = []
    for i in range(iters + 2):
        tags = [MessageTag("bench", i, k, Direction.FORWARD, 0) for k in range(len(buffers))]
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        if rank == 0:
            futures = [transport.send(peer, tag, buffer) for tag, buffer in zip(tags, buffers)]
        else:
            futures = [transport.recv(peer, tag, buffer) for tag, buffer in zip(tags, buffers)]
        for future in futures:
            future.result()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _worker(rank: int, args, port: int, results) -> None:
    device = "cpu" if args.toy else "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
        gloo = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        gloo = dist.group.WORLD
    from dyad.transport import UcxTransport

    with UcxTransport() as transport:
        addresses = [None, None]
        dist.all_gather_object(addresses, transport.address, group=gloo)
        peer = addresses[1 - rank]
        secret = b"boundary-bandwidth-bench-secret!"
        transport.authorize(secret, [peer])
        rows = {}
        for window in args.windows:
            for size_mb in (TOY_SIZES_MB if args.toy else GPU_SIZES_MB):
                buffers = [torch.randint(0, 255, (size_mb * MB,), dtype=torch.uint8, device=device) for _ in range(window)]
                nccl_s = _time_nccl(rank, buffers, args.iters, device, None if device == "cuda" else gloo)
                ucx_s = _time_ucx(rank, transport, peer, buffers, args.iters, device, gloo)
                nbytes = size_mb * MB * window
                rows[window, size_mb] = {"nccl_GBps": nbytes / nccl_s / 1e9, "ucx_GBps": nbytes / ucx_s / 1e9}
                del buffers
        dist.barrier(group=gloo)
    if rank == 1:
        results.update(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 8, 64], help="messages of each size in flight at once")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not args.toy and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs (or --toy)")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args, port, results), nprocs=2, join=True)
        rows = dict(results)
    label = "gloo" if args.toy else "NCCL"
    print(f"{'in flight':>9s} {'MB':>5s} {label + ' GB/s':>10s} {'ucxx GB/s':>10s} {'ucxx/' + label:>10s}")
    for (window, size_mb), row in sorted(rows.items()):
        print(f"{window:9d} {size_mb:5d} {row['nccl_GBps']:10.1f} {row['ucx_GBps']:10.1f} "
              f"{row['ucx_GBps'] / row['nccl_GBps']:10.2f}")
    if args.out:
        from dyad.ucx_progress import progress_mode

        info = {"device": "cpu" if args.toy else torch.cuda.get_device_name(), "torch": torch.__version__,
                "ucx_tls": os.environ.get("UCX_TLS", "(ucxx default)"), "ucx_progress": progress_mode(),
                "windows": {str(w): {str(mb): row for (w2, mb), row in sorted(rows.items()) if w2 == w} for w in args.windows}}
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
