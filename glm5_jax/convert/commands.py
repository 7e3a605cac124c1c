"""`glm5 import-hf` and `glm5 export-hf`: the released checkpoint in and out of a run directory.

    glm5 import-hf HF_DIR RUN_DIR [mesh.<axis>=N ...] [--param-dtype D] [--compute-dtype D] [--fp8-dtype D]
                   [--host-budget-gb 8]
    glm5 export-hf RUN_DIR OUT_DIR [mesh.<axis>=N ...] [--max-shard-size 5GB] [--step N] [--no-mtp]

The mesh (default: one device) must use every visible device; each process reads only its own shards.
"""

from __future__ import annotations

import argparse
import re
import resource
import sys
import time
from pathlib import Path

from glm5_jax.config import DTYPES

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MiB' / '1000000' -> bytes (transformers' max_shard_size spelling)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match and (match.group(2).upper() or "B")
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ValueError(f"--max-shard-size={text!r} is invalid: a positive size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _mesh(overrides: list[str]):
    from glm5_jax.parallel.mesh import MeshConfig, make_mesh

    sizes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("mesh.") or not value.isdigit():
            raise ValueError(f"argument {item!r} is invalid: expected mesh.<axis>=<size>, e.g. mesh.fsdp=8")
        sizes[key[len("mesh."):]] = int(value)
    return make_mesh(MeshConfig.from_mapping(sizes))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def import_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="glm5 import-hf", description="Import a Hugging Face GLM-5 "
                                     "checkpoint directory (bf16, fp32 or block-scaled FP8) into an orbax "
                                     "checkpoint that `glm5 train ... train.init_from=RUN_DIR` starts from.")
    parser.add_argument("hf_dir")
    parser.add_argument("run_dir")
    parser.add_argument("mesh", nargs="*", help="mesh.<axis>=N (data, fsdp, expert, tensor); default one device")
    parser.add_argument("--param-dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    parser.add_argument("--compute-dtype", choices=DTYPES, help="default: the checkpoint's config.json dtype")
    parser.add_argument("--fp8-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="what FP8 weights are dequantized to")
    parser.add_argument("--host-budget-gb", type=float, default=8.0,
                        help="device slices built on the host at once (slices sharing layers/experts are built "
                        "together so each tensor is read once)")
    args = parser.parse_args(argv)
    from glm5_jax.convert.streaming_import import import_hf, save_imported

    try:
        start = time.perf_counter()
        imported = import_hf(args.hf_dir, mesh=_mesh(args.mesh), param_dtype=args.param_dtype,
                             compute_dtype=args.compute_dtype, fp8_dtype=args.fp8_dtype,
                             host_budget_bytes=max(1, int(args.host_budget_gb * 2**30)))
        loaded = time.perf_counter() - start
        save_imported(imported, args.run_dir, source=args.hf_dir)
    except (ValueError, FileExistsError) as err:
        print(f"glm5 import-hf: {err}", file=sys.stderr)
        return 2
    print(f"dtypes: {imported.dtype_note}")
    if imported.dequantized:
        print(f"dequantized {len(imported.dequantized)} FP8 tensors to {args.fp8_dtype}, e.g. "
              f"{imported.dequantized[:3]} (full list in the checkpoint's config item)")
    print(f"read in {loaded:.1f}s, saved in {time.perf_counter() - start - loaded:.1f}s; peak host memory "
          f"{_peak_rss_gib():.2f} GiB")
    print(f"wrote {Path(args.run_dir) / 'checkpoints'} and {Path(args.run_dir) / 'model.yaml'}")
    return 0


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="glm5 export-hf", description="Export a run directory's parameters "
                                     "as a sharded Hugging Face checkpoint (released layout, MTP included).")
    parser.add_argument("run_dir", help="holds checkpoints/ and model.yaml (an import) or config.yaml (a run)")
    parser.add_argument("out_dir")
    parser.add_argument("mesh", nargs="*", help="mesh.<axis>=N to restore onto; default one device")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--step", type=int, help="default: the latest")
    parser.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    args = parser.parse_args(argv)
    from glm5_jax.convert.sharded_export import export_hf

    try:
        params, config = restore_run_params(Path(args.run_dir), _mesh(args.mesh), args.step)
        files = export_hf(params, config, args.out_dir, max_shard_bytes=parse_size(args.max_shard_size),
                          include_mtp=not args.no_mtp)
    except ValueError as err:
        print(f"glm5 export-hf: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} safetensors files to {args.out_dir}; peak host memory {_peak_rss_gib():.2f} GiB")
    return 0


def restore_run_params(run_dir: Path, mesh, step: int | None = None):
    """(params restored sharded over `mesh` in the dtypes they were saved in, ModelConfig) of a run
    directory: an import keeps bf16 weights (and a bf16 router bias) bf16, a training run its master dtype."""
    import jax
    import orbax.checkpoint as ocp

    from glm5_jax.config import load_model_config
    from glm5_jax.parallel.sharding import abstract_params, param_shardings
    from glm5_jax.tree_paths import path_string

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

        targets = jax.tree_util.tree_map_with_path(target, abstract, param_shardings(abstract, mesh))
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(targets)))
    return restored["params"], config
