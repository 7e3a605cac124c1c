"""Shared helpers of the GPU ahead-of-time compile tests: compile-only NVIDIA GPU devices described by the CUDA
plugin from a target config (no GPU, no CUDA driver needed), abstract inputs placed on one of them, and what the
compiled module holds: the Pallas Triton kernels and the shared memory each asks for."""

from __future__ import annotations

import functools
import importlib.util
import re

import jax
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.gpu_targets import gpu_target_config

# Custom-call targets of a Pallas Triton kernel: compiled by XLA (jaxlib <= 0.10.2) or by jax while lowering
# (newer jaxlib).
PALLAS_TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def cuda_plugin_installed() -> bool:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


@functools.cache
def gpu_sharding(target: str) -> NamedSharding:
    """Replicated sharding on a one-GPU mesh of compile-only `target` devices (e.g. "h100")."""
    devices = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(target),
                                           topology="1x1x1").devices
    return NamedSharding(Mesh(devices[:1], ("gpu",)), PartitionSpec())


def on_gpu(tree, target: str):
    """ShapeDtypeStructs (or arrays) -> ShapeDtypeStructs placed on the target's one-GPU mesh."""
    sharding = gpu_sharding(target)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def lower_for(fn, args, target: str):
    """fn(*args) lowered for the target GPU. Its device is also the default one: newer jax picks the GPU
    architecture of a Pallas Triton kernel from the default device's kind (CPU here otherwise)."""
    sharding = gpu_sharding(target)
    with jax.default_device(sharding.mesh.devices.flat[0]):
        return jax.jit(fn).trace(*on_gpu(args, target)).lower()


def triton_kernel_names(compiled_text: str) -> list[str]:
    """Name of each Pallas Triton kernel (custom call) in a compiled module's text, in order."""
    names = []
    for line in compiled_text.splitlines():
        if any(f'custom_call_target="{call}"' in line for call in PALLAS_TRITON_CALLS):
            found = re.search(r'name = \\?"([A-Za-z0-9_]+)', line)
            names.append(found.group(1) if found else "?")
    return names


@functools.cache
def _triton_smem_bytes(module: bytes, num_warps: int, num_stages: int) -> int:
    """Shared memory of one Triton module compiled for sm_90, once per process (H100 and H200 share kernels)."""
    from jax._src.lib import triton  # the CUDA plugin registers its Triton compiler here

    return triton.compile("CUDA", module, "9.0", num_warps=num_warps, num_ctas=1, num_stages=num_stages).smem_bytes


def triton_shared_memory(lowered) -> dict[str, int]:
    """Shared memory (bytes) each Pallas Triton kernel of a lowered module asks for, by kernel name: its Triton
    module compiled for sm_90 by the CUDA plugin's Triton compiler, as XLA compiles it (jaxlib <= 0.10.2 keeps
    the Triton module in the custom call's backend config; XLA's compiled text does not show the size)."""
    from jaxlib.mlir import ir

    found = {}

    def visit(operation):
        for region in operation.regions:
            for block in region:
                for op in block.operations:
                    visit_op(op.operation)

    def visit_op(op):
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == \
                PALLAS_TRITON_CALLS[0]:
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            found[ir.StringAttr(config["name"]).value] = _triton_smem_bytes(
                ir.StringAttr(config["ir"]).value_bytes, ir.IntegerAttr(config["num_warps"]).value,
                ir.IntegerAttr(config["num_stages"]).value)
        visit(op)

    visit(lowered.compiler_ir("stablehlo").operation)
    return found


def require_cuda_plugin() -> None:
    if not cuda_plugin_installed():
        pytest.skip("jax-cuda12-plugin is not installed (test extra): it compiles for GPUs without one")
