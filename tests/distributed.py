"""Run a function on N CPU ranks with gloo, as separate spawned processes.

    def body(rank, world_size, arg): ...       # module-level, so spawn can pickle it
    run_distributed(body, 4, arg)

A failure on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, store_path, fn, args, errors):
    # A file store: no port to pick, so no race with other tests' listeners.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        dist.destroy_process_group()
        raise
    dist.barrier()  # no rank tears down its connections while another still uses them
    dist.destroy_process_group()
    # Skip interpreter teardown: a C++ thread left joinable by a torch.distributed component
    # (seen with DTensor's device mesh on gloo) aborts the process at exit now and then.
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout_s: float = 300.0) -> None:
    with tempfile.TemporaryDirectory(prefix="dyad-dist-") as store_dir:
        _run_ranks(fn, world_size, args, os.path.join(store_dir, "store"), timeout_s)


def _run_ranks(fn, world_size: int, args: tuple, store_path: str, timeout_s: float) -> None:
    context = mp.get_context("spawn")
    errors = context.SimpleQueue()
    processes = [
        context.Process(target=_entry, args=(rank, world_size, store_path, fn, args, errors))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout_s)
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, trace = sorted(failures)[0]
        raise AssertionError(f"rank {rank} failed:\n{trace}")
    if hung:
        raise AssertionError(f"{len(hung)} rank(s) did not finish within {timeout_s}s")
    codes = [p.exitcode for p in processes]
    if any(codes):
        raise AssertionError(f"ranks exited with codes {codes}")
