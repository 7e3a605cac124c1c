"""The DSA kernels are built for the devices a trainer runs or compiles on: `pallas_platform: auto` takes the
devices' platform (a TPU pod described on this CPU host gets Mosaic kernels, not the host's Triton default), a
platform naming the other kind of accelerator is refused by name, and CPU devices keep what was configured.
The grouped matmul follows the platform computed on: under `jax.default_device(cpu)` on a GPU host, the CPU's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ConfigError
from glm5_jax.distributed.batch_local import mesh_platform
from glm5_jax.model.experts import experts_ragged, experts_reference
from glm5_jax.ops.platform import compiled_device_kind, compiled_platform, kernels_for_devices
from glm5_jax.parallel.topology import get_topology
from pallas_kernels._common import resolve_interpret
from pallas_model import small_pallas_model


def _devices(platform: str, kind: str):
    return [SimpleNamespace(platform=platform, device_kind=kind)]


@pytest.mark.parametrize("platform, kind, built", [("tpu", "TPU v5p", "tpu"), ("gpu", "NVIDIA H200", "gpu"),
                                                   ("cuda", "NVIDIA H200", "gpu")])
def test_auto_becomes_the_devices_platform(platform, kind, built):
    config = kernels_for_devices(small_pallas_model("auto"), _devices(platform, kind))
    assert config.pallas_platform == built and config.pallas_options == dict(platform=built, interpret=False)
    assert kernels_for_devices(small_pallas_model(built), _devices(platform, kind)).pallas_platform == built


def test_kernels_for_the_other_accelerator_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"model.pallas_platform='tpu'.*NVIDIA H200.*'gpu'"):
        kernels_for_devices(small_pallas_model("tpu"), _devices("gpu", "NVIDIA H200"))
    with pytest.raises(ConfigError, match=r"model.pallas_platform='gpu'.*TPU v5p.*'tpu'"):
        kernels_for_devices(small_pallas_model("gpu"), _devices("tpu", "TPU v5p"))


def test_cpu_devices_and_other_backends_keep_the_config():
    for platform in ("auto", "tpu", "gpu"):  # on CPU: the kernels' interpret modes, as configured
        config = small_pallas_model(platform)
        assert kernels_for_devices(config, jax.devices("cpu")) is config
    sparse = dataclasses.replace(small_pallas_model("tpu"), attention_backend="sparse")
    assert kernels_for_devices(sparse, _devices("gpu", "NVIDIA H200")) is sparse


def test_the_default_device_sets_the_platform_on_an_accelerator_host(monkeypatch):
    """On an H200 the tiny-model check ran its CPU reference under `jax.default_device(cpu)`, and the MoE's
    grouped matmul took the default backend's Triton kernel ("Only interpret mode is supported on CPU backend").
    The same chain as `MoE.__call__` without a mesh: `mesh_platform(None)`, then `experts_ragged`."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert compiled_platform() == "gpu" and resolve_interpret(None) is False
    with jax.default_device("cpu"):
        assert compiled_platform() == "cpu" and resolve_interpret(None) is True
    assert compiled_platform("tpu") == "tpu"
    keys = jax.random.split(jax.random.key(0), 5)
    experts = {name: jax.random.normal(key, shape) for name, key, shape in
               (("gate_proj", keys[0], (4, 8, 6)), ("up_proj", keys[1], (4, 8, 6)), ("down_proj", keys[2], (4, 6, 8)))}
    x = jax.random.normal(keys[3], (5, 8))
    expert_ids = jax.random.randint(keys[4], (5, 2), 0, 4)
    weights = jnp.full((5, 2), 0.5)
    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.jit(lambda *a: experts_ragged(*a, platform=mesh_platform(None)))(experts, x, expert_ids, weights)
    np.testing.assert_allclose(got, experts_reference(experts, x, expert_ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.tpu_aot
def test_the_chip_compiled_for_names_itself_inside_shard_map():
    """The grouped matmul sizes its tiles from the chip's VMEM: traced for a v6e pod described on this CPU host,
    the chip is the v6e, not the host."""
    mesh = jax.sharding.Mesh(np.array(get_topology("v6e-8").devices()), ("chips",))
    seen = []

    def local(x):
        seen.append(compiled_device_kind())
        return x

    spec = jax.sharding.PartitionSpec("chips")
    jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)).trace(
        jax.ShapeDtypeStruct((8,), jnp.float32))
    assert seen == ["TPU v6 lite"]
    assert compiled_device_kind() == jax.devices()[0].device_kind  # outside: the default device's
