"""Device descriptions of NVIDIA GPUs (`stream_executor.GpuTargetConfigProto` text), for compiling XLA:GPU and
Triton programs ahead of time on a machine without the GPU:
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"), ...)`.
"""

from __future__ import annotations

from pathlib import Path

_FOLDER = Path(__file__).resolve().parent
GPU_TARGETS = tuple(sorted(path.stem for path in _FOLDER.glob("*.txtpb")))


def gpu_target_config(name: str) -> str:
    """The text proto describing GPU `name` (one of `GPU_TARGETS`, e.g. "h100", "h200")."""
    if name not in GPU_TARGETS:
        raise ValueError(f"GPU target {name!r} is invalid: known targets are {list(GPU_TARGETS)}")
    return (_FOLDER / f"{name}.txtpb").read_text()
