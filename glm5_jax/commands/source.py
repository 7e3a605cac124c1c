"""SOURCE of `glm5 generate / eval / rollout`: a run directory (`glm5 train` or `glm5 import-hf`; its latest
checkpoint or `--step N`) or a Hugging Face checkpoint directory (config.json + safetensors), checked before
anything is read, and its parameters placed on the mesh (the run's `mesh:` section, then `mesh.<axis>=N`
arguments; -1 takes the devices the other axes leave) with the training run's shardings. `mesh.context` > 1
splits each sequence (and generation's cache) over that many chips.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import jax
import yaml

from glm5_jax.config import ModelConfig
from glm5_jax.config.experiment import default_mesh
from glm5_jax.config.mesh import MeshConfig, mesh_values
from glm5_jax.convert.hf import load_hf_checkpoint
from glm5_jax.convert.run_dir import restore_run_params
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.parallel.sharding import shard_params


class CommandError(ValueError):
    """A command-line input is invalid; the message names it (argument, file:line, record) and what is valid."""


@dataclasses.dataclass(frozen=True, eq=False)
class ModelSource:
    path: Path
    kind: str                  # "run" or "hf"
    params: dict
    config: ModelConfig
    step: int                  # the checkpoint step read (0 for a Hugging Face checkpoint)
    run_config: dict | None    # the run's config.yaml as plain data (a `glm5 train` run only)
    tokenizer: object
    mesh: jax.sharding.Mesh


def checkpoint_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def source_kind(path: str | Path) -> str:
    """"run" or "hf" for a usable SOURCE; CommandError naming what is missing otherwise."""
    path = Path(path)
    if not path.exists():
        raise CommandError(f"SOURCE {str(path)!r} does not exist: give a run directory (written by `glm5 train` "
                           "or `glm5 import-hf`) or a Hugging Face checkpoint directory (config.json + safetensors)")
    if not path.is_dir():
        raise CommandError(f"SOURCE {str(path)!r} is a file: give a run directory or a Hugging Face checkpoint "
                           "directory")
    if (path / "config.json").is_file():
        return "hf"
    if not any((path / name).exists() for name in ("checkpoints", "config.yaml", "model.yaml")):
        raise CommandError(f"SOURCE {str(path)!r} is neither a run directory (checkpoints/ with config.yaml or "
                           "model.yaml) nor a Hugging Face checkpoint directory (config.json)")
    if not checkpoint_steps(path):
        raise CommandError(f"SOURCE {str(path)!r} has no checkpoint yet (checkpoints/ is missing or empty): "
                           "train it first (`glm5 train`) or import one (`glm5 import-hf`)")
    return "run"


def _mesh(run_config: dict | None, items: list[str]):
    values = default_mesh({**((run_config or {}).get("mesh") or {}), **mesh_values(items, usage="mesh.<axis>=<size>, e.g. mesh.fsdp=2")})
    return make_mesh(MeshConfig.from_mapping(values).resolve(jax.device_count()))


def _tokenizer_spec(path: Path, kind: str, run_config: dict | None, given: str | None) -> str:
    if given:
        return given
    if run_config is not None:
        return (run_config.get("data") or {}).get("tokenizer", "byte")
    return str(path) if kind == "hf" and (path / "tokenizer.json").is_file() else "byte"


@contextlib.contextmanager
def _params_only_restore_quiet():
    """Orbax warns (through absl's logger) about every checkpoint item a params-only restore leaves unread
    and about opening a directory read-only: both are what is asked here."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_source(path: str | Path, *, step: int | None = None, mesh_items: list[str] = (),
                tokenizer: str | None = None) -> ModelSource:
    """Check SOURCE, then restore its parameters (the latest step unless `step`) onto the mesh."""
    path = Path(path)
    kind = source_kind(path)
    run_config = None
    if kind == "run" and (path / "config.yaml").is_file():
        run_config = yaml.safe_load((path / "config.yaml").read_text())
    mesh = _mesh(run_config, list(mesh_items))
    tokenizer = load_tokenizer(_tokenizer_spec(path, kind, run_config, tokenizer))
    if kind == "hf":
        if step is not None:
            raise CommandError(f"--step={step} is invalid for a Hugging Face checkpoint (it holds one set of weights)")
        params, config = load_hf_checkpoint(path)
        return ModelSource(path, kind, shard_params(params, mesh, config=config), config, 0, None, tokenizer,
                           mesh)
    steps = checkpoint_steps(path)
    if step is not None and step not in steps:
        raise CommandError(f"--step={step} is invalid: {path / 'checkpoints'} holds steps {steps}")
    step = steps[-1] if step is None else step
    with _params_only_restore_quiet():
        params, config = restore_run_params(path.absolute(), mesh, step)  # orbax wants absolute paths
    return ModelSource(path, kind, params, config, step, run_config, tokenizer, mesh)


def stop_ids(source: ModelSource) -> tuple[int, ...]:
    """The tokenizer's stop tokens that the model can emit (end of text, the next role marker)."""
    return tuple(i for i in source.tokenizer.eos_ids if i is not None and i < source.config.vocab_size)


def decode_text(source: ModelSource, ids) -> str:
    """Text of generated ids; a final stop token is left out, ids beyond the tokenizer (vocabulary padding
    an untrained model may emit) are skipped."""
    ids = [int(i) for i in ids]
    if ids and ids[-1] in stop_ids(source):
        ids = ids[:-1]
    return source.tokenizer.decode([i for i in ids if i < source.tokenizer.vocab_size])
