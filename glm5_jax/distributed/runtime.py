"""Many hosts on JAX's multi-controller runtime: starting `jax.distributed`, global batches from each process's
rows, and gathering small host-side values (data-iterator positions) to every process.

Every process runs the same program; each feeds only the rows its own devices hold, and checkpoints are
written by all of them together (orbax). `initialize`:
- "auto": join a job when one is described: `JAX_COORDINATOR_ADDRESS` (with `JAX_NUM_PROCESSES`,
  `JAX_PROCESS_ID`), a SLURM job step of several tasks, or a multi-host TPU slice; otherwise run alone;
- "on": always call `jax.distributed.initialize()` (JAX's own cluster auto-detection);
- "off": never.
A process that stops heart-beating for `heartbeat_timeout_s` makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from glm5_jax.config.distributed import DistributedConfig

class DistributedError(RuntimeError):
    """The multi-process runtime cannot start, or processes disagree."""


def cluster_described(environ=os.environ) -> bool:
    """Whether the environment describes a multi-process job that `jax.distributed.initialize()` can join."""
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")) or 1) > 1:
        return True
    hosts = environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def initialize(cfg: DistributedConfig) -> bool:
    """Start `jax.distributed` as `cfg` says; returns whether this process is part of a multi-process job.
    Must run before anything touches a device."""
    cfg.validate()
    if cfg.initialize == "off" or (cfg.initialize == "auto" and not cluster_described()):
        return False
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    # CPU devices of different processes talk over TCP (gloo); accelerators keep their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = {}
    for key, env in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
        if os.environ.get(env, "") != "":
            try:
                explicit[key] = int(os.environ[env])
            except ValueError:
                raise DistributedError(f"{env}={os.environ[env]!r} is invalid: must be an integer") from None
    try:
        jax.distributed.initialize(heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                                   initialization_timeout=cfg.init_timeout_s, **explicit)
    except Exception as err:  # the coordinator is unreachable, the environment is incomplete, ...
        raise DistributedError(
            f"jax.distributed.initialize failed ({err}); set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES "
            "and JAX_PROCESS_ID on every process (or run under SLURM / on a TPU pod), or distributed.initialize=off"
        ) from None
    return jax.process_count() > 1


def is_primary() -> bool:
    """Process 0 writes logs, metrics and TensorBoard files."""
    return jax.process_index() == 0


def process_row_block(sharding, global_rows: int) -> tuple[int, int]:
    """[start, stop) of the global batch rows this process's devices hold under `sharding` (leading dim).
    Fails when they are not one contiguous block (then rows could not come from this process's shards)."""
    indices = sharding.addressable_devices_indices_map((global_rows,))
    starts = sorted({(idx[0].start or 0, global_rows if idx[0].stop is None else idx[0].stop)
                     for idx in indices.values()})
    start, stop = starts[0][0], starts[-1][1]
    covered = sum(b - a for a, b in starts)
    if covered != stop - start:
        raise DistributedError(f"process {jax.process_index()} holds rows {starts} of the batch: not one "
                               "contiguous block; order the mesh devices by process")
    return start, stop


def global_batch(local: dict, sharding, global_rows: int) -> dict:
    """One global array per batch key, from the rows this process holds (numpy [local_rows, ...])."""
    def make(value):
        value = np.asarray(value)
        return jax.make_array_from_process_local_data(sharding, value, (global_rows, *value.shape[1:]))
    return {key: make(value) for key, value in local.items()}


def allgather_json(value) -> list:
    """Every process's JSON-able `value`, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int32))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:int(n)]).decode()) for row, n in zip(gathered, sizes.reshape(-1))]
