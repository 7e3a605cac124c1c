"""The model of a run that starts from another one (`train.init_from=RUN`): taken from that run, so a config
needs no hand-copied model section. The parameters are trained in fp32 (`param_dtype`) unless the config
says otherwise, whatever dtype the run stored them in.

RUN holds `model.yaml` (written by `glm5 import-hf`) or `config.yaml` (written by `glm5 train`). A config
without a model section gets that model whole. A config with one may set only the fields that leave the
weights unchanged (backends, dtypes, remat, scan, the DSA top-k, MTP depth, ...);
any other field that differs from the run's is refused, naming each such field and both values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from glm5_jax.config.core import ConfigError, ModelConfig, from_dict, load_yaml

# How the weights are used, not what they are: a config may choose these freely over the run's (index_topk:
# DSA continued pre-training moves the same weights from dense attention to top-k, configs/dsa_*.yaml).
EXECUTION_FIELDS = ("attention_backend", "pallas_platform", "flash_every_key", "sparse_row_gradients", "moe_backend",
                    "moe_capacity_factor", "ep_transport", "ep_row_block", "moe_kernel_vmem_mib",
                    "param_dtype", "compute_dtype", "remat_policy", "scan_layers", "index_query_chunk",
                    "index_key_block", "index_topk", "mtp_num_steps")
# Training keeps fp32 master weights (ModelConfig's default) whatever dtype the run stored (bf16 for an import).
MASTER_DTYPE = ModelConfig.param_dtype


def run_model_file(run_dir: str | Path) -> Path:
    """RUN/model.yaml (an import) or RUN/config.yaml (a training run), whichever exists."""
    run_dir = Path(run_dir)
    for name in ("model.yaml", "config.yaml"):
        if (run_dir / name).is_file():
            return run_dir / name
    raise ConfigError(f"train.init_from={str(run_dir)!r} is invalid: it has neither model.yaml (written by "
                      "`glm5 import-hf`) nor config.yaml (written by `glm5 train`), so its model is unknown")


def run_model_section(run_dir: str | Path) -> tuple[dict, Path]:
    """(the run's model fields as plain data, the file they come from)."""
    path = run_model_file(run_dir)
    data = load_yaml(path)
    section = data.get("model") if isinstance(data.get("model"), dict) else data
    if path.name == "config.yaml" and not isinstance(data.get("model"), dict):
        raise ConfigError(f"{path}: has no model: section, so train.init_from={str(run_dir)!r} has no model")
    return dict(section), path


def agreeing_model(given: dict | None, model: ModelConfig, origin: str) -> dict:
    """`model`'s fields as plain data with a config's own model section (`given`, possibly None) applied, which
    may change only EXECUTION_FIELDS; `origin` says where `model` comes from in the error."""
    given = dict(given or {})
    wanted = from_dict(ModelConfig, {**dataclasses.asdict(model), **given}, prefix="model.")
    disagree = [name for name in given
                if name not in EXECUTION_FIELDS and getattr(wanted, name) != getattr(model, name)]
    if disagree:
        fields = "; ".join(f"model.{name}={getattr(wanted, name)!r} but {getattr(model, name)!r} there"
                           for name in disagree)
        raise ConfigError(f"the model section disagrees with {origin}: {fields}. Leave the model section out (the "
                          f"model comes from there) or make those fields equal; only {list(EXECUTION_FIELDS)} may "
                          "differ")
    return {**dataclasses.asdict(model), **given}


def model_for_init_from(given: dict | None, run_dir: str | Path) -> dict:
    """The model section of a config that starts from `run_dir`: the run's model, with the config's own
    section (`given`, possibly None) allowed to change only EXECUTION_FIELDS."""
    run_section, path = run_model_section(run_dir)
    run_model = dataclasses.replace(from_dict(ModelConfig, run_section, prefix=f"{path}: model."),
                                    param_dtype=MASTER_DTYPE)
    return agreeing_model(given, run_model, f"train.init_from={str(run_dir)!r} ({path})")
