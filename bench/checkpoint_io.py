"""Where a pool checkpoint's time goes, one process: `dyad.checkpoint.save_pool` with one writer
thread (DCP's default) and with `--threads`, with `--threads` unsynced and then synced as the
router's commit thread syncs it, `restore_pool` with one reader thread and with its default
(`dyad.checkpoint.READER_THREADS`) at several read batch sizes, and
beside them the parts: reading the files' bytes alone, and the save's copy of every full tensor
to host memory alone (ordinary memory, page-locked memory, ordinary from four threads). Each
restore starts from scrambled state and must bring back every tensor's sum and sum of squares.
The model: `--layers` bias-free 4096 x
4096 linear layers with fused AdamW state after one step (12 bytes a parameter: 96 layers are a
19 GB checkpoint), on the GPU when there is one. Each save overwrites the last; the restores read
the last. Prints each time; writes JSON.

    python bench/checkpoint_io.py --work /tmp/ckpt --out $OUT/checkpoint_io.json   # GPU host
    python bench/checkpoint_io.py --toy                                            # CPU, tiny (CI)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from run_info import bench_device, run_header, write_json  # beside this script
from torch import nn

from dyad import checkpoint
from dyad.router.checkpoints import sync_tree
from dyad.router.launcher import free_ports

# (batch MB, reader threads) of each restore: one thread (the restore before READER_THREADS),
# then the default at three batch sizes.
RESTORES = [(1024, 1), (1024, checkpoint.READER_THREADS), (256, checkpoint.READER_THREADS),
            (4096, checkpoint.READER_THREADS)]


def trained_model(layers: int, dim: int, device: str):
    """The model and its AdamW after one step (so the moments exist)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
    model(torch.randn(2, dim, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


def seconds(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def read_bytes(directory: Path) -> int:
    """Reads every file of the checkpoint, 64 MB at a time; returns the bytes read."""
    buffer, total = bytearray(1 << 26), 0
    for path in checkpoint.pool_dir(directory, "llm").iterdir():
        with open(path, "rb", buffering=0) as f:
            while read := f.readinto(buffer):
                total += read
    return total


def fingerprints(model, optimizer) -> dict[str, tuple[float, float]]:
    """Each checkpointed tensor's sum and sum of squares (float64)."""
    return {
        key: (full.double().sum().item(), full.double().square().sum().item())
        for key, full in checkpoint._full_entries(model, optimizer)
    }


@torch.no_grad()
def scramble(model, optimizer) -> None:
    for param in model.parameters():
        param.fill_(7.0)
        for moment in checkpoint.MOMENTS:
            optimizer.state[param][moment].fill_(7.0)


def copy_to_host(model, optimizer) -> None:
    """Every full tensor to ordinary (pageable) host memory, one after the other: the save's copies."""
    for _, full in checkpoint._full_entries(model, optimizer):
        full.detach().cpu()


def copy_to_pinned_host(model, optimizer) -> None:
    """Every full tensor into page-locked host memory, queued without waiting, then one wait; the
    memory is handed back to the system after (as a one-off save would have to)."""
    copies = []
    for _, full in checkpoint._full_entries(model, optimizer):
        host = torch.empty(full.shape, dtype=full.dtype, pin_memory=full.is_cuda)
        copies.append(host.copy_(full.detach(), non_blocking=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        del copies
        checkpoint.empty_host_cache()


def copy_to_host_threads(model, optimizer, threads: int = 4) -> None:
    """Every full tensor to pageable host memory, `threads` copies at a time."""
    with ThreadPoolExecutor(threads) as pool:
        for copy in [pool.submit(full.detach().cpu) for _, full in checkpoint._full_entries(model, optimizer)]:
            copy.result()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true", help="CPU, a tiny model (keeps the script working)")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument(
        "--threads", type=int, default=checkpoint.WRITER_THREADS, help="writer threads of the second save"
    )
    parser.add_argument("--work", help="where the checkpoint is written (default: a temporary directory)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    layers, dim = (2, 64) if args.toy else (args.layers, 4096)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, optimizer = trained_model(layers, dim, device)
    work = Path(args.work or tempfile.mkdtemp(prefix="dyad-checkpoint-io-"))
    times = {}

    def timed(name: str, fn) -> None:
        times[name] = seconds(fn, device)
        print(f"{name:48s} {times[name]:7.2f} s", flush=True)

    for threads in (1, args.threads):
        shutil.rmtree(work, ignore_errors=True)
        timed(
            f"save, {threads} writer thread(s)",
            partial(checkpoint.save_pool, work, "llm", model, optimizer, step=1, writer_threads=threads),
        )
    # What the router's background commit takes off the training path: the same save left in the
    # page cache (`checkpoint.sync_in_background`), then the router's sync of its files.
    shutil.rmtree(work, ignore_errors=True)
    timed(
        f"save, {args.threads} threads, unsynced",
        partial(checkpoint.save_pool, work, "llm", model, optimizer, step=1,
                writer_threads=args.threads, sync_files=False),
    )
    timed("... then the router's sync", lambda: sync_tree(checkpoint.pool_dir(work, "llm")))
    saved = fingerprints(model, optimizer)
    for mb, threads in RESTORES:
        scramble(model, optimizer)  # so that each restore has to put every byte back
        name = f"restore, {mb} MB batches, {threads} reader thread(s)"
        timed(name, partial(checkpoint.restore_pool, work, "llm", model, optimizer,
                            batch_bytes=mb << 20, reader_threads=threads))
        if fingerprints(model, optimizer) != saved:
            raise SystemExit(f"{name}: did not bring back the saved state")
    timed("read the files' bytes alone", lambda: read_bytes(work))
    timed("copy the tensors to host alone", lambda: copy_to_host(model, optimizer))
    timed("... to pinned host memory", lambda: copy_to_pinned_host(model, optimizer))
    timed("... to host, 4 threads", lambda: copy_to_host_threads(model, optimizer))
    timed("... to host again", lambda: copy_to_host(model, optimizer))
    timed("... to pinned host memory again", lambda: copy_to_pinned_host(model, optimizer))
    stored = sum(path.stat().st_size for path in checkpoint.pool_dir(work, "llm").iterdir())
    print(f"checkpoint: {stored / 1e9:.2f} GB in {len(list(checkpoint.pool_dir(work, 'llm').iterdir()))} files")
    write_json(
        args.out,
        {
            **run_header(device),
            "layers": layers,
            "dim": dim,
            "threads": args.threads,
            "bytes": stored,
            "seconds": times,
        },
    )
    dist.destroy_process_group()
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
