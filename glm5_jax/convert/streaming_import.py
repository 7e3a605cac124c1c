"""Import a Hugging Face checkpoint directory straight onto a mesh, one tensor at a time.

Every parameter is a global array built from the slices each process's own devices hold (as
`jax.make_array_from_callback`, one slice at a time): a slice is assembled from the HF tensors under it,
read one at a time (routed experts are stacked slice by slice, never as a whole host stack), and moved to
its devices before the next is read. Host memory beyond the device shards: one device's slice of a leaf
plus the tensor in flight (read, and its transposed copy). Stored dtypes are kept unless a dtype is asked;
FP8 weights are dequantized on the way in and listed in the result.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import yaml
from jax.sharding import Mesh, SingleDeviceSharding

from glm5_jax.config import DTYPES, ModelConfig
from glm5_jax.convert.checkpoint_config import model_config_from_checkpoint
from glm5_jax.convert.hf_layout import is_recipe
from glm5_jax.convert.import_plan import ItemCache, plan_import, read_leaf_slice
from glm5_jax.convert.tensor_source import CheckpointDir

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


def global_array(shape: tuple[int, ...], sharding, read_slice) -> jax.Array:
    """`jax.make_array_from_callback`, but each distinct slice is read and moved to its devices before the
    next is read (make_array_from_callback builds every local slice on the host first, which for a stacked
    expert weight is the process's whole share of it)."""
    devices_by_slice: dict[tuple, list] = {}
    index_of: dict[tuple, tuple] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        devices_by_slice.setdefault(key, []).append(device)
        index_of[key] = index
    shards = []
    for key, devices in devices_by_slice.items():
        host = read_slice(index_of[key])
        shards += [jax.device_put(host, device) for device in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def import_hf(path: str | Path, *, mesh: Mesh | None = None, config: ModelConfig | None = None,
              param_dtype: str | None = None, compute_dtype: str | None = None, fp8_dtype: str = "bfloat16",
              require_mtp: bool = False) -> ImportedCheckpoint:
    """Read the checkpoint directory `path` into global arrays sharded over `mesh` by the rule table (one
    device when None). The config comes from its config.json unless given."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (glm5_jax.parallel.mesh.make_mesh), got "
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
        from glm5_jax.parallel.sharding import param_shardings

        shardings = param_shardings(abstract, mesh)
    cache = ItemCache()

    def build(recipe, dtype, sharding):
        array = global_array(recipe.shape, sharding, lambda index: read_leaf_slice(source, recipe, dtype, index, cache))
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
