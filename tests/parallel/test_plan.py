"""`glm5 plan`: exact parameter / optimizer / communication arithmetic against independent counts, the remat
and capacity effects, the 744B configuration on 256 devices, settings validation and the CLI. (The memory
estimate against XLA's compiled memory analysis is checked in test_multidevice.py.)"""

import dataclasses
import json

import numpy as np
import pytest

from glm5_jax.cli import main as cli_main
from glm5_jax.cli import parse_plan_items
from glm5_jax.config import load_model_config
from glm5_jax.model.param_count import count_params
from glm5_jax.distributed.mesh import MeshConfig
from glm5_jax.parallel.plan import PlanError, PlanSettings, plan

TINY = load_model_config("configs/tiny.yaml", ["moe_backend=ep"])


@pytest.mark.slow
def test_unsharded_params_grads_and_adamw_state_match_parameter_counts():
    report = plan(TINY, MeshConfig(), PlanSettings(batch=2, seq=32, optimizer="adamw"))
    memory = report["memory_bytes"]
    counts = count_params(TINY)
    biases = TINY.n_routed_experts * (TINY.num_moe_layers + 1)  # e_score_correction_bias: no optimizer state
    assert memory["params"] == memory["grads"] == 4 * counts["total"]
    # Two fp32 moments per trainable value, plus two int32 step counts (Adam's and the learning-rate
    # schedule's) in each of the two AdamW groups (with and without weight decay).
    assert memory["optimizer_state"] == 2 * 4 * (counts["total"] - biases) + 4 * 4
    assert report["communication_bytes"] == {"fsdp_all_gather": 0, "fsdp_reduce_scatter": 0, "data_all_reduce": 0,
                                             "expert_all_to_all": 0, "tensor_all_reduce": 0,
                                             "context_all_gather": 0}
    muon = plan(TINY, MeshConfig(), PlanSettings(batch=2, seq=32, optimizer="muon"))["memory_bytes"]
    assert memory["optimizer_state"] > muon["optimizer_state"] > memory["optimizer_state"] // 2


@pytest.mark.slow
def test_data_parallel_all_reduce_and_fsdp_volumes():
    total = 4 * count_params(TINY)["total"]
    data = plan(TINY, MeshConfig(data=2), PlanSettings(batch=2, seq=32))
    assert data["memory_bytes"]["params"] == total
    assert data["communication_bytes"]["data_all_reduce"] == total  # ring: 2 (n - 1) / n of the bytes
    fsdp = plan(TINY, MeshConfig(fsdp=4), PlanSettings(batch=4, seq=32))
    sharded = fsdp["memory_bytes"]["params"]
    assert total / 4 <= sharded < total / 4 * 1.02  # only norms and biases stay whole
    comm = fsdp["communication_bytes"]
    assert comm["fsdp_reduce_scatter"] * 2 == comm["fsdp_all_gather"]  # gathered for forward and backward


@pytest.mark.slow
def test_remat_and_capacity_reduce_activation_memory():
    settings = dict(batch=8, seq=64)
    mesh = MeshConfig(expert=8)
    none = plan(TINY, mesh, PlanSettings(remat="none", **settings))["memory_bytes"]
    full = plan(TINY, mesh, PlanSettings(remat="full", **settings))["memory_bytes"]
    assert full["activations_saved"] < none["activations_saved"]
    capped = dataclasses.replace(TINY, moe_capacity_factor=1.0)
    capped_memory = plan(capped, mesh, PlanSettings(remat="none", **settings))["memory_bytes"]
    assert capped_memory["activations_saved"] < none["activations_saved"]


def test_keeping_the_expert_projections_and_a_bf16_momentum_are_counted():
    """`full_keep_experts` keeps each MoE layer's (and MTP step's) gate/up projections of its received rows, which
    the CPU trace cannot see; `mu_dtype=bfloat16` halves the fp32 model's Muon momentum (AdamW's second moment
    stays fp32)."""
    settings = dict(batch=8, seq=64)
    mesh = MeshConfig(expert=8)
    full = plan(TINY, mesh, PlanSettings(remat="full", **settings))["memory_bytes"]
    kept = plan(TINY, mesh, PlanSettings(remat="full_keep_experts", **settings))["memory_bytes"]
    # Dropless (the tiny model's capacity factor 0) with one expert per device: each of the 8 devices' 64 tokens
    # can send it one row.
    assert TINY.moe_capacity_factor == 0 and TINY.n_routed_experts == 8
    rows = 8 * settings["batch"] * settings["seq"] // 8
    moe_layers = TINY.num_moe_layers + (TINY.mtp_num_steps if TINY.num_nextn_predict_layers else 0)
    want = moe_layers * rows * 2 * TINY.moe_intermediate_size * np.dtype(TINY.compute_dtype).itemsize
    assert kept["activations_saved"] - full["activations_saved"] == pytest.approx(want, rel=0.05)
    bf16 = plan(TINY, mesh, PlanSettings(remat="full", mu_dtype="bfloat16", **settings))["memory_bytes"]
    assert 0.5 * full["optimizer_state"] < bf16["optimizer_state"] < 0.75 * full["optimizer_state"]
    with pytest.raises(PlanError, match="mu_dtype='fp8' is invalid"):
        parse_plan_items(["mu_dtype=fp8"])


@pytest.mark.slow
def test_glm5_on_256_h200():
    config = load_model_config("configs/glm5_744b.yaml", ["moe_backend=ep", "attention_backend=pallas"])
    report = plan(config, MeshConfig(fsdp=32, expert=8), PlanSettings(batch=256, seq=4096, remat="full"))
    memory, comm = report["memory_bytes"], report["communication_bytes"]
    # 754B fp32 values split 256 ways (experts over expert x fsdp, the rest over fsdp) -> about 12 GiB each.
    assert 11.5e9 < memory["params"] < 14.5e9
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert report["fits"] == (memory["total"] <= 141 * 2**30)
    assert comm["expert_all_to_all"] > 0 and comm["tensor_all_reduce"] == 0


def test_invalid_settings_name_the_field():
    with pytest.raises(PlanError, match=r"batch=6 is invalid: .* data \* fsdp \* expert = 4"):
        plan(TINY, MeshConfig(fsdp=4), PlanSettings(batch=6, seq=32))
    ragged = load_model_config("configs/tiny.yaml")
    with pytest.raises(PlanError, match="model.moe_backend='ragged' cannot be planned"):
        plan(ragged, MeshConfig(expert=2), PlanSettings(seq=32))
    with pytest.raises(PlanError, match="mesh.tensor=3 is invalid"):
        plan(TINY, MeshConfig(tensor=3), PlanSettings(seq=32))
    with pytest.raises(PlanError, match=r"optimizer='sgd' is invalid"):
        parse_plan_items(["optimizer=sgd"])
    with pytest.raises(PlanError, match=r"seq='long' is invalid"):
        parse_plan_items(["seq=long"])
    with pytest.raises(PlanError, match="expected key=value"):
        parse_plan_items(["fsdp"])


def test_cli_prints_table_and_json(capsys):
    assert cli_main(["plan", "configs/tiny.yaml", "mesh.data=1", "batch=2", "seq=32", "remat=full",
                     "device_memory_gib=0.001"]) == 0
    out = capsys.readouterr().out
    assert "per-device memory" in out and "expert all-to-all" in out
    assert "verdict: does not fit in 0.001 GiB" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["remat"] == "full" and report["fits"] is False
    assert cli_main(["plan", "configs/tiny.yaml", "mesh.tensor=0"]) == 2
    assert "mesh.tensor=0 is invalid" in capsys.readouterr().err
