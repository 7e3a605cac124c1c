"""Orbax checkpoints of a training run: params, optimizer state, step, data-iterator state and config.

One `Checkpointer` per run directory. Each saved step is a folder `<directory>/<step>` holding the items
"params" and "opt_state" (orbax standard pytrees), "data_state" and "config" (JSON). Orbax writes a step into
a temporary folder and renames it only once every item is complete, so a crash mid-save leaves the earlier
steps as the latest restorable ones; leftover temporary folders are ignored and cleaned up on start.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from glm5_jax.tree_paths import path_string


class CheckpointError(ValueError):
    """A checkpoint cannot be written or restored as asked."""


class NonFiniteStateError(CheckpointError):
    """Refused to save: the loss or the parameters are not finite."""


@dataclasses.dataclass(frozen=True)
class RestoredCheckpoint:
    step: int
    params: Any
    opt_state: Any  # None when restored without an optimizer-state target
    data_state: Any  # the JSON value given to `save` (e.g. a grain iterator's `get_state()`), or None
    config: Any  # the config saved with the step, as plain JSON data, or None


def _shapes_by_path(tree) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_string(path): tuple(leaf.shape) for path, leaf in flat}


def _saved_as_heads_first(path: str, saved: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a leaf is an attention o_proj kernel (or an optimizer moment of one) saved [.., H, P, D], as
    checkpoints before 2026-12-05 hold it, where the model now keeps [.., D, H, P] (`glm5_jax.model.attention`)."""
    return (path.endswith("o_proj/kernel") and len(target) >= 3 and saved != target
            and saved == target[:-3] + target[-2:] + target[-3:-2])


def _heads_first(leaf):
    """The abstract target of a leaf as it was saved [.., H, P, D], its sharding's spec permuted alike."""
    shape = leaf.shape[:-3] + leaf.shape[-2:] + leaf.shape[-3:-2]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
            *spec[:-3], *spec[-2:], spec[-3]))
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)


def _as_saved(tree, saved: dict[str, tuple[int, ...]]):
    """`tree`'s abstract targets, with each leaf saved in an earlier layout (`_saved_as_heads_first`) in that."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _heads_first(leaf) if _saved_as_heads_first(
            path_string(path), saved.get(path_string(path), tuple(leaf.shape)), tuple(leaf.shape)) else leaf,
        _abstract(tree))


def _to_target(restored, target):
    """Restored leaves laid out as `target` wants them: those saved [.., H, P, D] moved to [.., D, H, P]."""
    def move(leaf, want):
        if tuple(leaf.shape) == tuple(want.shape):
            return leaf
        sharding = getattr(want, "sharding", None)
        return jax.jit(lambda x: jnp.moveaxis(x, -1, -3), out_shardings=sharding)(leaf)
    return jax.tree.map(move, restored, _abstract(target))


def _abstract(tree):
    """Shape/dtype/sharding targets for orbax, from concrete or already-abstract arrays."""
    def leaf(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(leaf, tree)


def _as_json(name: str, value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{name} must be JSON-serialisable (a dict of numbers, strings, lists): {err}") from err


@jax.jit
def _finite_flags(leaves: list) -> jax.Array:
    """One flag per leaf, in one program: a check per leaf would compile two small programs per leaf shape."""
    return jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves])


def _first_non_finite(tree) -> str | None:
    floating = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
                if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if not floating:
        return None
    bad = np.flatnonzero(~np.asarray(_finite_flags([leaf for _, leaf in floating])))
    return path_string(floating[bad[0]][0]) if bad.size else None


class Checkpointer:
    """Save every `save_interval_steps` steps, keep the newest `max_to_keep`, restore the latest by default."""

    def __init__(self, directory: str | Path, *, save_interval_steps: int = 1000, max_to_keep: int = 3,
                 enable_async: bool = False, read_only: bool = False):
        """`read_only`: for reading another run's checkpoints; its temporary folders may belong to a live
        save, so they are left alone."""
        for name, value in (("save_interval_steps", save_interval_steps), ("max_to_keep", max_to_keep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"{name}={value!r} is invalid: must be an integer >= 1")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps, max_to_keep=max_to_keep, create=not read_only,
            cleanup_tmp_directories=not read_only, enable_async_checkpointing=enable_async, read_only=read_only)
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "data_state": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # -- saving ---------------------------------------------------------------------------------

    def save(self, step: int, *, params, opt_state, data_state: Any = None, config: Any = None,
             force: bool = False) -> bool:
        """Save `step` if it falls on the save interval (or `force`); returns whether it was saved."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"step={step!r} is invalid: must be a non-negative integer")
        if not force and not self._manager.should_save(step):
            return False
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            data_state=ocp.args.JsonSave({"value": _as_json("data_state", data_state)}),
            config=ocp.args.JsonSave({"value": _as_json("config", config)}),
        )
        return bool(self._manager.save(step, args=args, force=force))

    def save_if_finite(self, step: int, *, loss, params, opt_state, data_state: Any = None, config: Any = None,
                       force: bool = False) -> bool:
        """Like `save`, but raise NonFiniteStateError instead of writing a NaN/inf loss, parameter or optimizer
        state (inf second moments from an inf gradient leave the loss finite and poison every later step)."""
        if not force and not self._manager.should_save(step):
            return False
        bad = f"loss={float(loss)}" if not math.isfinite(float(loss)) else None
        for name, tree in (("params", params), ("opt_state", opt_state)):
            leaf = bad is None and _first_non_finite(tree)
            bad = bad or (leaf and f"{name}['{leaf}']")
        if bad:
            raise NonFiniteStateError(
                f"not saving step {step}: {bad} is not finite; the last good checkpoint "
                f"(step {self.latest_step()}) in {self.directory} is kept")
        return self.save(step, params=params, opt_state=opt_state, data_state=data_state, config=config,
                         force=force)

    def should_save(self, step: int) -> bool:
        """Whether `save(step)` without `force` would write (the same answer on every process)."""
        return bool(self._manager.should_save(step))

    # -- restoring ------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def saved_config(self, step: int | None = None) -> Any:
        """The config saved with `step` (default: the latest), read alone, before any array is restored."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return restored["config"]["value"]

    def restore(self, params, opt_state=None, *, step: int | None = None) -> RestoredCheckpoint:
        """Restore `step` (default: the latest) into the structure, dtypes and shardings of the targets.

        `params` / `opt_state` may be concrete arrays or `jax.ShapeDtypeStruct`s (with shardings, to restore
        directly into a sharded layout). Without `opt_state` the optimizer state is not read.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint to restore in {self.directory}")
        elif step not in self._manager.all_steps():
            raise CheckpointError(f"step={step} is not in {self.directory}; available steps: {self.all_steps()}")
        self._check_param_shapes(step, params)
        items = {"params": ocp.args.StandardRestore(_as_saved(params, self._saved_shapes(step, "params"))),
                 "data_state": ocp.args.JsonRestore(), "config": ocp.args.JsonRestore()}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(
                _as_saved(opt_state, self._saved_shapes(step, "opt_state")))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"cannot restore step {step} from {self.directory} into the given optimizer state "
                f"(a different optimizer config?): {err}") from err
        return RestoredCheckpoint(step=step, params=_to_target(restored["params"], params),
                                  opt_state=_to_target(restored["opt_state"], opt_state) if opt_state is not None
                                  else None,
                                  data_state=restored["data_state"]["value"], config=restored["config"]["value"])

    def _saved_shapes(self, step: int, item: str) -> dict[str, tuple[int, ...]]:
        metadata = self._manager.item_metadata(step)[item]
        return _shapes_by_path(getattr(metadata, "tree", metadata))

    def _check_param_shapes(self, step: int, params) -> None:
        stored = self._saved_shapes(step, "params")
        target = _shapes_by_path(params)
        for path, shape in target.items():
            if path not in stored:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} has no parameter '{path}' "
                                      f"(target shape {shape})")
            if stored[path] != shape and not _saved_as_heads_first(path, stored[path], shape):
                raise CheckpointError(f"parameter '{path}' has shape {stored[path]} in checkpoint step {step} "
                                      f"but {shape} in the target model: refusing to restore")
        extra = sorted(set(stored) - set(target))
        if extra:
            raise CheckpointError(f"checkpoint step {step} has parameter '{extra[0]}' (shape {stored[extra[0]]}) "
                                  "that the target model lacks")

    # -- lifecycle ------------------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
