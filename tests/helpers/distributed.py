"""Run a function on N CPU ranks with gloo, as separate processes forked from a forkserver.

    def body(rank, world_size, arg): ...       # module-level, so that it pickles
    run_distributed(body, 4, arg)

A failure on any rank fails the test with that rank's traceback. The forkserver imports torch and
dyad once (and dynamo, which the first optimizer imports); each rank forks from it instead of
importing them again, about 5 s of CPU a rank, paid hundreds of times over the suite on a 2-core
CI machine.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dyad.cpus import usable_cpus, worker_threads

# Imported by the forkserver before it forks the ranks: what every rank body needs.
_PRELOAD = [
    "torch", "torch.distributed", "torch._dynamo",
    "dyad.service", "dyad.llm_service.parallelize", "dyad.encoder_service.parallelize",
]


def _entry(rank, world_size, store_path, fn, args, errors):
    # Each rank its share of the CPUs, as the local launcher gives its workers (dyad/cpus.py):
    # a thread per CPU in every rank would spin against the other ranks' threads.
    torch.set_num_threads(worker_threads(usable_cpus(), world_size))
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


def run_each(calls: list[tuple], world_size: int, timeout_s: float = 300.0) -> None:
    """`fn(rank, world_size, *args)` for each (fn, args) of `calls` in turn, in one run of the
    ranks (one start of them, not one a call)."""
    run_distributed(_each, world_size, calls, timeout_s=timeout_s)


def _each(rank, world_size, calls):
    for fn, args in calls:
        fn(rank, world_size, *args)


def _run_ranks(fn, world_size: int, args: tuple, store_path: str, timeout_s: float) -> None:
    context = _forkserver()
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


def _forkserver():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first call
    return context


def llm_and_parallel_twin(cfg, degrees: dict, sequence_parallel: bool):
    """(groups, the single-device MoELM, its parallelized copy's GradientReduction, the copy) for
    a spawned rank of the layout `degrees`: the same weights on every rank (seed 0)."""
    import copy

    from dyad.layout import LLMLayout
    from dyad.llm_service.model import MoELM
    from dyad.llm_service.parallelize import parallelize_llm
    from dyad.parallel.groups import ProcessGroups
    from dyad.parallel.overlap import GradientReduction

    torch.manual_seed(0)
    groups = ProcessGroups.build(LLMLayout(**degrees))
    reference = MoELM(cfg)
    model = copy.deepcopy(reference)
    plan = parallelize_llm(model, groups, sequence_parallel=sequence_parallel)
    return groups, reference, GradientReduction(plan, groups, overlap=False), model
