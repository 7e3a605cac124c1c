"""An experiment = one YAML file with sections model / optim / train / data / checkpoint (/ mesh / distributed /
rl), loaded with `key=value` overrides (`train.steps=50`, `model.index_topk=64`), every section parsed into its
dataclass and validated before anything compiles. With `train.init_from=RUN` the model section may be left out:
the model is that run's (`init_model.py`). `experiment_to_dict` writes it back in the file's layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, TypeVar

from glm5_jax.config.core import (CheckpointConfig, ConfigError, DataConfig, ModelConfig, TrainConfig, _fail,
                                  apply_overrides, from_dict, load_yaml, require_finite_floats)
from glm5_jax.config.distributed import DistributedConfig
from glm5_jax.config.init_model import model_for_init_from
from glm5_jax.config.mesh import MeshConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.config.rl import RLStepConfig, rl_step_config_as_dict, rl_step_config_from_dict

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig
    optim: OptimConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    mesh: MeshConfig = MeshConfig(fsdp=-1)
    distributed: DistributedConfig = DistributedConfig()
    rl: RLStepConfig | None = None  # train.mode == "rl"

    def validate(self) -> "ExperimentConfig":
        try:
            self.model.validate()
        except ConfigError as err:  # ModelConfig names its fields bare; here they live under model:
            message = str(err)
            raise ConfigError(message if message.startswith("model.") else "model." + message) from None
        self.optim.validate()
        self.train.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.distributed.validate()
        validate_mesh_fit(self)
        if self.train.mode == "dsa_warmup" and self.optim.trainable == "all":
            _fail("optim.trainable", self.optim.trainable,
                  "the DSA dense warm-up trains the indexer only: set optim.trainable=indexer")
        chunk, seq_len = self.model.index_query_chunk, self.train.seq_len
        if 0 < chunk < seq_len and seq_len % chunk:
            # The blocks would silently fall back to one block of every query, with its memory.
            _fail("model.index_query_chunk", chunk, f"must divide train.seq_len={seq_len} (or be 0 or >= it)")
        if self.train.mode == "rl" and self.rl is None:
            _fail("rl", self.rl, "train.mode=rl needs an rl: section (loss, eps_low, eps_high, ...)")
        return self


def default_mesh(values: dict) -> dict:
    """As MaxText does, FSDP takes the devices no other axis claims unless the config says otherwise: with no
    `mesh:` section a run uses every visible device."""
    if "fsdp" in values or -1 in values.values():
        return values
    return {**values, "fsdp": -1}


def validate_mesh_fit(cfg: "ExperimentConfig") -> None:
    """Every fixed mesh axis must divide what it shards (a -1 axis is checked once the devices are known)."""
    mesh, model, train = cfg.mesh, cfg.model, cfg.train
    batch_shards = 1
    for axis in ("data", "fsdp", "expert"):
        size = getattr(mesh, axis)
        batch_shards *= max(size, 1)
    per_step = train.batch_size // train.microbatches
    if per_step % batch_shards:
        _fail("train.batch_size", train.batch_size,
              f"each of the {train.microbatches} microbatches ({per_step} rows) must split evenly over "
              f"mesh.data x mesh.fsdp x mesh.expert = {batch_shards} batch shards")
    if mesh.tensor > 1:
        for field in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
            if getattr(model, field) % mesh.tensor:
                _fail("mesh.tensor", mesh.tensor, f"must divide model.{field}={getattr(model, field)}")
    if mesh.expert > 1 and model.n_routed_experts % mesh.expert:
        _fail("mesh.expert", mesh.expert, f"must divide model.n_routed_experts={model.n_routed_experts}")
    if mesh.context > 1:
        validate_context_split(mesh.context, train.seq_len, model.index_query_chunk)


def validate_context_split(context: int, seq_len: int, query_chunk: int = 0) -> None:
    """`mesh.context` splits each sequence into 2 x context equal chunks, two per chip in the load-balanced
    causal order; each chunk's queries run in blocks of `index_query_chunk`."""
    if seq_len % (2 * context):
        _fail("mesh.context", context, f"must split train.seq_len={seq_len} into 2 x {context} equal chunks: make "
              f"the sequence length a multiple of {2 * context}")
    local = seq_len // (2 * context) if context > 1 else seq_len
    if 0 < query_chunk < local and local % query_chunk:
        # The blocks would silently fall back to one block of the chunk's every query, with its memory.
        _fail("model.index_query_chunk", query_chunk, f"must divide the {local} queries of each of a chip's two "
              f"chunks (train.seq_len={seq_len} / (2 x mesh.context={context})), or be 0 or >= it")


SECTIONS = {"model": ModelConfig, "optim": OptimConfig, "train": TrainConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "mesh": MeshConfig, "distributed": DistributedConfig}


def experiment_from_dict(data: dict) -> ExperimentConfig:
    unknown = sorted(set(data) - set(SECTIONS) - {"rl"})
    if unknown:
        _fail(unknown[0], data[unknown[0]], f"unknown section; known sections are {sorted(SECTIONS) + ['rl']}")
    for name in [*SECTIONS, "rl"]:
        if data.get(name) is not None and not isinstance(data[name], dict):
            _fail(name, data[name], f"the {name}: section must be a mapping of field: value lines")
    init_from = (data.get("train") or {}).get("init_from")
    if isinstance(init_from, str) and init_from:
        data = {**data, "model": model_for_init_from(data.get("model"), init_from)}
    elif not data.get("model"):
        _fail("model", data.get("model"), "the config has no model: section; give one, or set "
              "train.init_from=RUN to take the model of that run (a `glm5 train` run or a `glm5 import-hf` import)")
    kwargs = {name: from_dict(cls, data.get(name) or {}, prefix=name + ".") for name, cls in SECTIONS.items()
              if name != "mesh"}
    kwargs["mesh"] = from_dict(MeshConfig, default_mesh(data.get("mesh") or {}), prefix="mesh.")
    for name, section in kwargs.items():  # directly-built sections (optim) skip the loader's finite check
        require_finite_floats(section, name + ".")
    rl = rl_step_config_from_dict(data["rl"]) if data.get("rl") else None  # an empty rl: section is no section
    return ExperimentConfig(**kwargs, rl=rl).validate()


def experiment_to_dict(cfg: ExperimentConfig) -> dict:
    """Plain data in the layout of an experiment file (what config.yaml and checkpoints store)."""
    return {**dataclasses.asdict(cfg), "rl": None if cfg.rl is None else rl_step_config_as_dict(cfg.rl)}


def parse_config_file(path: str | Path, overrides: list[str] | None, parse: Callable[[dict], T]) -> T:
    """`parse` of the YAML file at `path` with `section.key=value` overrides applied (the parser every
    subcommand uses); an error names the file."""
    data = apply_overrides(load_yaml(path), overrides or [])
    try:
        return parse(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    return parse_config_file(path, overrides, experiment_from_dict)
