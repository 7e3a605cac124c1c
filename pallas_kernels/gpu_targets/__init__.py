"""Device descriptions of NVIDIA GPUs (XLA GpuTargetConfig text protos) for compiling for them on a host without
one: `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"),
topology="1x1x1")` (the CUDA plugin `jax-cuda12-plugin` / `jax-cuda12-pjrt` of jax's version installed)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
GPU_TARGETS = tuple(sorted(path.stem for path in _HERE.glob("*.txtpb")))


def gpu_target_config(name: str) -> str:
    """The text proto of GPU `name` (one of GPU_TARGETS: "h100", "h200")."""
    if name not in GPU_TARGETS:
        raise ValueError(f"GPU target {name!r} is unknown; known: {GPU_TARGETS}")
    return (_HERE / f"{name}.txtpb").read_text()
