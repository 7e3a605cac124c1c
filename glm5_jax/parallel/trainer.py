"""One trainer: an experiment's mesh, optimizer, state shardings, objective and jitted step, built by one
function for `glm5 train` (glm5_jax.runner), `glm5 compile` (glm5_jax.parallel.aot, from shapes alone) and the
asynchronous RL driver (glm5_jax.rollout.async_rl).

Everything is derived from the parameters' shapes (`abstract_params`), so the concrete and the abstract
trainer are the same object: `init_state` / `state_from` create the state already sharded,
`abstract_state` / `abstract_batch` describe it without allocating anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm5_jax.config import ConfigError
from glm5_jax.config.experiment import ExperimentConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.distributed.logical_axes import logical_to_spec
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.distributed.runtime import DistributedError, global_batch, process_row_block
from glm5_jax.ops.platform import kernels_for_devices
from glm5_jax.parallel.sharding import (abstract_params, init_opt_state_sharded, init_sharded, opt_state_shardings,
                                        param_shardings)
from glm5_jax.train.objective import make_objective
from glm5_jax.train.optim import learning_rate_schedule, make_optimizer
from glm5_jax.train.rl_step import rl_optim_config
from glm5_jax.train.step import TrainState, make_train_step


class MeshLayout:
    """An experiment's mesh over `devices` (default: every device of the job) and the sharding of its batch:
    only the leading (row) dim is named, so one sharding serves batch keys of any rank."""

    def __init__(self, experiment: ExperimentConfig, devices: Sequence[jax.Device] | None = None):
        devices = list(jax.devices() if devices is None else devices)
        mesh_config = experiment.mesh.resolve(len(devices))
        self.mesh = make_mesh(mesh_config, devices)
        self.rows, microbatches = experiment.train.batch_size, experiment.train.microbatches
        shards = mesh_config.data * mesh_config.fsdp * mesh_config.expert
        if (self.rows // microbatches) % shards:
            raise ConfigError(f"train.batch_size={self.rows} is invalid: each of the {microbatches} microbatches "
                              f"must split evenly over the {shards} batch shards of mesh {mesh_config.axis_sizes()}")
        self.batch = NamedSharding(self.mesh, logical_to_spec(("batch",), (self.rows,), self.mesh))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    def global_batch(self, local: dict) -> dict:
        """The global batch from this process's rows of it."""
        return global_batch(local, self.batch, self.rows)

    def require_equal_process_rows(self) -> None:
        """Every process of the job must hold the same number of batch rows (its data shards' share)."""
        start, stop = process_row_block(self.batch, self.rows)
        if stop - start != self.rows // jax.process_count():
            raise DistributedError(f"process {jax.process_index()} holds {stop - start} of {self.rows} batch rows; "
                                   "each process must hold an equal share: make the batch axes span the processes")


@dataclasses.dataclass(frozen=True)
class Trainer:
    experiment: ExperimentConfig
    layout: MeshLayout
    optim_config: OptimConfig  # the experiment's; in RL with the indexer frozen unless rl.train_indexer
    optimizer: optax.GradientTransformation
    lr_schedule: Callable
    objective: Any  # glm5_jax.train.objective
    state_shardings: TrainState
    step: Callable  # validates the batch, then runs `step.jitted(state, batch) -> (state, metrics)`

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    def init_params(self, rng: jax.Array):
        """Freshly initialised parameters, every leaf created in its shard."""
        return init_sharded(self.experiment.model, rng, self.mesh)

    def init_state(self, params) -> TrainState:
        """Step 0 with `params` (already laid out as `state_shardings.params`) and a fresh optimizer state
        created in its shards."""
        opt_state = init_opt_state_sharded(self.optimizer, params, self.layout.mesh, config=self.experiment.model)
        return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), self.layout.replicated), params=params,
                          opt_state=opt_state)

    def state_from(self, params) -> TrainState:
        """`init_state` from parameters laid out anyhow (copied: the step donates its state)."""
        copied = jax.tree.map(jnp.copy, params)
        return self.init_state(jax.device_put(copied, self.state_shardings.params))

    def abstract_state(self) -> TrainState:
        params = abstract_params(self.experiment.model)
        opt_state = jax.eval_shape(self.optimizer.init, params)
        return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=self.layout.replicated),
                          params=_with_shardings(params, self.state_shardings.params),
                          opt_state=_with_shardings(opt_state, self.state_shardings.opt_state))

    def abstract_batch(self) -> dict:
        """The [batch, seq] int32 fields the objective reads, sharded as the step takes them."""
        shape = (self.experiment.train.batch_size, self.experiment.train.seq_len)
        return {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.layout.batch)
                for key in self.objective.required_keys}


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(leaf.dtype),
                                                                    sharding=sharding), tree, shardings)


def build_trainer(experiment: ExperimentConfig, devices: Sequence[jax.Device] | None = None) -> Trainer:
    """The trainer of `experiment` over `devices` (default: every device of the job)."""
    layout = MeshLayout(experiment, devices)
    experiment = dataclasses.replace(experiment, model=kernels_for_devices(experiment.model,
                                                                           layout.mesh.devices.flat))
    optim_config = experiment.optim
    if experiment.train.mode == "rl":
        optim_config = rl_optim_config(optim_config, experiment.rl)  # the DSA indexer is frozen in RL by default
    params = abstract_params(experiment.model)
    model = experiment.model
    optimizer = make_optimizer(optim_config, params, config=model, mesh=layout.mesh)
    state_shardings = TrainState(
        step=layout.replicated, params=param_shardings(params, layout.mesh, config=model),
        opt_state=opt_state_shardings(jax.eval_shape(optimizer.init, params), layout.mesh, config=model))
    objective = make_objective(experiment.model, experiment.train, experiment.rl, layout.mesh)
    lr_schedule = learning_rate_schedule(optim_config)
    step = make_train_step(experiment.model, experiment.train, optimizer, objective=objective,
                           lr_schedule=lr_schedule, mesh=layout.mesh, state_shardings=state_shardings,
                           batch_sharding=layout.batch)
    return Trainer(experiment=experiment, layout=layout, optim_config=optim_config, optimizer=optimizer,
                   lr_schedule=lr_schedule, objective=objective, state_shardings=state_shardings, step=step)
