"""Import a Hugging Face checkpoint directory straight onto a mesh, one tensor at a time.

Every parameter is a global array built from the slices each process's own devices hold (as
`jax.make_array_from_callback`, one slice at a time): a slice is assembled from the HF tensors under it,
read one at a time (routed experts are stacked slice by slice, never as a whole host stack), and moved to
its devices before the next is read. Slices that cover the same layers/experts are built together (up to a
host budget) so each HF tensor is read once per process. Host memory beyond the device shards: that budget
(or one device's slice of a leaf, if larger) plus the tensor in flight (read, and its transposed copy). Stored dtypes are kept unless a dtype is asked;
FP8 weights are dequantized on the way in and listed in the result.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.sharding import Mesh, SingleDeviceSharding

from glm5_jax.config import DTYPES, ModelConfig
from glm5_jax.convert.checkpoint_config import model_config_from_checkpoint
from glm5_jax.convert.hf_layout import LeafRecipe, is_recipe
from glm5_jax.convert.import_plan import ItemCache, plan_import, read_leaf_slices, stack_part
from glm5_jax.convert.tensor_source import CheckpointDir
from glm5_jax.parallel.sharding import param_shardings

IMPORT_STEP = 0  # the orbax step an import is saved as


@dataclasses.dataclass
class ImportedCheckpoint:
    params: dict
    config: ModelConfig
    dtype_note: str            # which parameter / compute dtypes were chosen, and why
    dequantized: list[str]     # HF names of the FP8 tensors that were dequantized


def abstract_from_plan(plan) -> dict:
    return jax.tree.map(lambda recipe, dtype: jax.ShapeDtypeStruct(recipe.shape, dtype), plan.recipes,
                        plan.dtypes, is_leaf=is_recipe)


DEFAULT_HOST_BUDGET_BYTES = 8 * 2**30


def global_array(recipe: LeafRecipe, dtype, sharding, source, cache: ItemCache,
                 host_budget_bytes: int = DEFAULT_HOST_BUDGET_BYTES) -> jax.Array:
    """Like `jax.make_array_from_callback`, without building every local slice on the host first (for a
    stacked expert weight that is the process's whole share of it): distinct slices that cover the same
    stacked layers/experts are built together up to `host_budget_bytes` (each HF tensor under them read
    once), moved to their devices, and dropped before the next group is read."""
    devices_by_slice: dict[tuple, list] = {}
    index_of: dict[tuple, tuple] = {}
    for device, index in sharding.addressable_devices_indices_map(recipe.shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        devices_by_slice.setdefault(key, []).append(device)
        index_of[key] = index
    by_stack: dict[tuple, list] = {}
    for key in devices_by_slice:
        by_stack.setdefault(stack_part(recipe, index_of[key]), []).append(key)
    itemsize = np.dtype(dtype).itemsize

    def nbytes(key) -> int:
        return itemsize * math.prod(len(range(*s.indices(n))) for s, n in zip(index_of[key], recipe.shape))

    shards = []
    for keys in by_stack.values():
        groups, size = [[]], 0
        for key in keys:
            if groups[-1] and size + nbytes(key) > host_budget_bytes:
                groups.append([])
                size = 0
            groups[-1].append(key)
            size += nbytes(key)
        for group in groups:
            hosts = read_leaf_slices(source, recipe, dtype, [index_of[key] for key in group], cache)
            placed = [jax.device_put(host, device) for key, host in zip(group, hosts)
                      for device in devices_by_slice[key]]
            # device_put copies in the background and holds `hosts` until it is done: wait, or on a busy host
            # the next groups are read while earlier ones are still alive and the budget no longer bounds memory.
            shards += jax.block_until_ready(placed)
            del hosts
    return jax.make_array_from_single_device_arrays(recipe.shape, sharding, shards)


def import_hf(path: str | Path, *, mesh: Mesh | None = None, config: ModelConfig | None = None,
              param_dtype: str | None = None, compute_dtype: str | None = None, fp8_dtype: str = "bfloat16",
              require_mtp: bool = False, host_budget_bytes: int = DEFAULT_HOST_BUDGET_BYTES) -> ImportedCheckpoint:
    """Read the checkpoint directory `path` into global arrays sharded over `mesh` by the rule table (one
    device when None). The config comes from its config.json unless given. `host_budget_bytes` bounds the
    device slices built on the host at once (slices that share layers/experts are built together so their
    HF tensors are read once; a single larger slice is still built alone)."""
    if not isinstance(host_budget_bytes, int) or host_budget_bytes <= 0:
        raise ValueError(f"host_budget_bytes={host_budget_bytes!r} is invalid: must be a positive number of bytes")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (glm5_jax.distributed.mesh.make_mesh), got "
                         f"{type(mesh).__name__}")
    if fp8_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"fp8_dtype={fp8_dtype!r} is invalid: FP8 weights dequantize to 'bfloat16' or 'float32'")
    for name, value in (("param_dtype", param_dtype), ("compute_dtype", compute_dtype)):
        if value is not None and value not in DTYPES:
            raise ValueError(f"{name}={value!r} is invalid: must be one of {DTYPES}")
    source = CheckpointDir(path, fp8_dtype=fp8_dtype)
    if config is None:
        config, note = model_config_from_checkpoint(source.config, param_dtype=param_dtype,
                                                    compute_dtype=compute_dtype)
    else:
        if compute_dtype is not None:
            config = dataclasses.replace(config, compute_dtype=compute_dtype)
        note = f"parameters {param_dtype or 'as stored'}, compute {config.compute_dtype} (config given)"
    plan = plan_import(source, config, dtype=param_dtype, require_mtp=require_mtp)
    abstract = abstract_from_plan(plan)
    if mesh is None:
        if jax.process_count() > 1:
            raise ValueError(f"import_hf on {jax.process_count()} processes needs a mesh over their devices "
                             "(mesh.<axis>=N on the command line)")
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), abstract)
    else:
        shardings = param_shardings(abstract, mesh, config=config)
    cache = ItemCache()

    def build(recipe, dtype, sharding):
        array = global_array(recipe, dtype, sharding, source, cache, host_budget_bytes)
        cache.clear()
        return array

    params = jax.tree.map(build, plan.recipes, plan.dtypes, shardings, is_leaf=is_recipe)
    return ImportedCheckpoint(params, config, note, list(source.dequantized))


def save_imported(imported: ImportedCheckpoint, run_dir: str | Path, *, source: str = "",
                  host_buffer_gb: float = 1.0) -> Path:
    """Write the parameters as step 0 of `<run_dir>/checkpoints` in the layout of `glm5_jax.checkpoint`
    (params, data_state and config items; no optimizer state, so `train.init_from=<run_dir>` starts a fresh
    optimizer from them) and the model section as `<run_dir>/model.yaml`. Orbax copies shards to host
    memory to write them; at most `host_buffer_gb` of such copies are alive at once."""
    import orbax.checkpoint as ocp

    run_dir = Path(run_dir).absolute()
    checkpoints = run_dir / "checkpoints"
    if checkpoints.exists() and any(checkpoints.iterdir()):
        raise FileExistsError(f"{checkpoints} already holds checkpoints: import into a new run directory")
    record = {"imported_from": str(source), "dtypes": imported.dtype_note, "dequantized": imported.dequantized,
              "model": dataclasses.asdict(imported.config)}
    if not host_buffer_gb > 0:
        raise ValueError(f"host_buffer_gb={host_buffer_gb!r} is invalid: must be > 0 (GB of host copies in flight)")
    # Uncompressed: tensorstore's zstd path holds extra copies of what it writes (and bf16 weights barely
    # compress); host copies in flight are capped for hosts whose shards live in device memory.
    params_handler = ocp.PyTreeCheckpointHandler(use_compression=False,
                                                 save_device_host_concurrent_gb=host_buffer_gb)
    handlers = {"params": params_handler, "data_state": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(checkpoints, options=options, item_handlers=handlers) as manager:
        manager.save(IMPORT_STEP, args=ocp.args.Composite(
            params=ocp.args.PyTreeSave(imported.params), data_state=ocp.args.JsonSave({"value": None}),
            config=ocp.args.JsonSave({"value": json.loads(json.dumps(record))})), force=True)
        manager.wait_until_finished()
    if jax.process_index() == 0:
        model = json.loads(json.dumps(dataclasses.asdict(imported.config)))
        (run_dir / "model.yaml").write_text(
            f"# imported from {source} ({imported.dtype_note})\n" + yaml.safe_dump({"model": model}, sort_keys=False))
    return run_dir
