"""How many CPU threads each worker process gets where several share a machine or a pod.

Every process would otherwise start a thread per CPU for its CPU-side operations, and the
threads of a dozen processes spinning between parallel regions take the CPUs that launch the
GPU kernels (torchrun sets one thread for the same reason). The local launcher and a pod's
entrypoint give each worker its share through OMP_NUM_THREADS, unless the user set it, leaving
out the core each worker's UCX progress thread keeps busy where it polls (GPU hosts).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def worker_threads(cpus: int, workers: int, busy_per_worker: int = 0) -> int:
    """CPU threads for each of `workers` processes sharing `cpus`: their share of what is left
    after each keeps `busy_per_worker` cores busy on its own (UCX's polling progress thread,
    `dyad.ucx_progress.busy_threads`), at least one."""
    workers = max(1, workers)
    return max(1, (cpus - workers * busy_per_worker) // workers)


# PyTorch's own switch (read once, when the process first allocates): host tensors of 2 MB and
# more on transparent huge pages where the kernel offers them (`madvise` or `always`). A
# checkpoint's copies to host memory and reads from its files fault in 512 times fewer pages
# (docs/performance.md, "Four and eight GPUs (issue 8)", checkpoint I/O).
HUGE_PAGE_ALLOCATIONS = {"THP_MEM_ALLOC_ENABLE": "1"}


def worker_environment(base: Mapping[str, str], extra: Mapping[str, str], threads: int) -> dict[str, str]:
    """A worker's environment: `base` and `extra`, with OMP_NUM_THREADS=`threads` and
    `HUGE_PAGE_ALLOCATIONS` unless either sets them."""
    return {"OMP_NUM_THREADS": str(threads)} | HUGE_PAGE_ALLOCATIONS | dict(base) | dict(extra)


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may run on, no more than its cgroup's CPU quota (a pod's CPU limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max)
    return max(1, min(cpus, quota)) if quota is not None else cpus


def cgroup_cpu_quota(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """The cgroup v2 CPU quota in whole CPUs (rounded up), or None when unlimited or unknown.
    cpu.max reads "<quota> <period>" in microseconds, or "max <period>"."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return math.ceil(int(quota) / int(period))
