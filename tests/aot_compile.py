"""Shared helpers of the TPU ahead-of-time compile tests: a one-chip mesh of libtpu-described TPU devices
(no TPU needed), abstract inputs placed on it, and the scoped VMEM each compiled Mosaic kernel uses."""

from __future__ import annotations

import functools
import json
import re

import jax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm5_jax.parallel.topology import TopologyError, get_topology

CHIPS = ("v5p", "v6e")
# Smallest default scoped-VMEM limit of these chips (v5p 16 MiB, v6e 32 MiB): every kernel must fit under it.
SCOPED_VMEM_LIMIT = 16 * 2**20


@functools.cache
def chip_sharding(chip: str) -> NamedSharding:
    """Replicated sharding on a one-chip mesh of `chip` (its first TensorCore / chip of a v*-8 slice)."""
    try:
        devices = get_topology(f"{chip}-8").devices()
    except TopologyError as err:
        pytest.fail(f"libtpu must be installed for the TPU compile tier (test extra): {err}")
    return NamedSharding(Mesh(devices[:1], ("chip",)), PartitionSpec())


def on_chip(tree, chip: str):
    """ShapeDtypeStructs (or arrays) -> ShapeDtypeStructs placed on the chip's one-device mesh."""
    sharding = chip_sharding(chip)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_for(fn, args, chip: str):
    """XLA's TPU compiler and libtpu's Mosaic compiler on `fn(*args)`, for `chip`."""
    return jax.jit(fn).trace(*on_chip(args, chip)).lower().compile()


def mosaic_vmem_bytes(compiled) -> list[int]:
    """Scoped VMEM of each Mosaic kernel (tpu_custom_call) in a compiled module, as libtpu allotted it."""
    sizes = []
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        config = re.search(r'"used_scoped_memory_configs":(\[[^\]]*\])', line)
        sizes.append(max((int(c["size"]) for c in json.loads(config.group(1))), default=0) if config else 0)
    return sizes
