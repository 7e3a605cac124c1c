"""GPU device descriptions (XLA GpuTargetConfig text protos) for compiling for NVIDIA GPUs without one:
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"), ...)`.
"""

from __future__ import annotations

from pathlib import Path

GPU_TARGETS = ("h100", "h200")


def gpu_target_config(name: str) -> str:
    """The GpuTargetConfig text proto of GPU `name` (one of GPU_TARGETS)."""
    if name not in GPU_TARGETS:
        raise ValueError(f"GPU target must be one of {GPU_TARGETS}; got {name!r}")
    return (Path(__file__).parent / f"{name}.txtpb").read_text()
