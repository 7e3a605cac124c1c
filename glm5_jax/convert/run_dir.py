"""Run directories as `glm5 import-hf` / `glm5 export-hf` see them: the mesh named on the command line, shard
sizes such as "5GB", and a run's latest parameters restored sharded in the dtypes they were saved in."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from glm5_jax.config import load_model_config
from glm5_jax.config.mesh import MeshConfig, mesh_values
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.parallel.sharding import abstract_params, param_shardings
from glm5_jax.tree_paths import path_string

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MiB' / '1000000' -> bytes (transformers' max_shard_size spelling)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match and (match.group(2).upper() or "B")
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ValueError(f"--max-shard-size={text!r} is invalid: a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def mesh_from_overrides(overrides: list[str]):
    """The mesh of `mesh.<axis>=N` arguments (default: one device on every axis)."""
    return make_mesh(MeshConfig.from_mapping(mesh_values(overrides)))


def restore_run_params(run_dir: Path, mesh, step: int | None = None):
    """(params restored sharded over `mesh` in the dtypes they were saved in, ModelConfig) of a run
    directory: an import keeps bf16 weights (and a bf16 router bias) bf16, a training run its master dtype."""
    config_file = next((f for f in (run_dir / "model.yaml", run_dir / "config.yaml") if f.is_file()), None)
    if config_file is None:
        raise ValueError(f"{run_dir} has neither model.yaml (written by import-hf) nor config.yaml (a run)")
    if not (run_dir / "checkpoints").is_dir():
        raise ValueError(f"{run_dir} has no checkpoints/ directory")
    config = load_model_config(config_file)
    abstract = abstract_params(config)
    options = ocp.CheckpointManagerOptions(create=False, read_only=True)
    with ocp.CheckpointManager(run_dir / "checkpoints", options=options,
                               item_handlers={"params": ocp.StandardCheckpointHandler()}) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise ValueError(f"step {step} is not in {run_dir / 'checkpoints'} (steps: {list(manager.all_steps())})")
        metadata = manager.item_metadata(step)["params"]
        flat = jax.tree_util.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]
        stored = {path_string(p): m for p, m in flat}

        def target(path, leaf, sharding):
            name = path_string(path)
            if name not in stored or tuple(stored[name].shape) != tuple(leaf.shape):
                raise ValueError(f"parameter '{name}' of {config_file} (shape {tuple(leaf.shape)}) is not in "
                                 f"step {step} of {run_dir / 'checkpoints'} with that shape")
            return jax.ShapeDtypeStruct(leaf.shape, stored[name].dtype, sharding=sharding)

        targets = jax.tree_util.tree_map_with_path(target, abstract, param_shardings(abstract, mesh, config=config))
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(targets)))
    return restored["params"], config
