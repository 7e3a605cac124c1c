"""Give both sides of a comparison the same CPU cores.

torch takes its intra-op thread count from `torch.set_num_threads`; XLA:CPU (jax 0.10.2) sizes its thread pools
from the CPUs the process may run on, and ignores `--xla_cpu_multi_thread_eigen=false` (checked: with that flag
its `tf_XLAEigen` worker still does a third of a jitted matmul chain's CPU time; pinned to one CPU, the worker
does none). So each side is pinned to the same first N allowed CPUs with `sched_setaffinity`, before jax starts
its backend (jax may already be imported: the CPU client is created at its first use), and torch also gets N
threads."""

from __future__ import annotations

import os


def limit_cpus(threads: int) -> list[int]:
    """Pin this process (and the threads it starts later) to its first `threads` allowed CPUs; returns them."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(allowed):
        raise ValueError(f"threads={threads} is invalid: must be in [1, {len(allowed)}] (the CPUs this process may "
                         f"use: {allowed})")
    chosen = allowed[:threads]
    os.sched_setaffinity(0, set(chosen))
    return chosen
