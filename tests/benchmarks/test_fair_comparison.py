"""The helpers that make the HF comparisons fair: the same CPUs for both sides, the same repeats with their
spread, turns in ABBA order, and HF's own settings (sdpa, gradient checkpointing) on the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.repeats import spread_of, turn_order

ROOT = Path(__file__).resolve().parents[2]


def test_turn_order_alternates_abba():
    assert turn_order(["jax", "hf"], 3) == [(0, "jax"), (0, "hf"), (1, "hf"), (1, "jax"), (2, "jax"), (2, "hf")]
    with pytest.raises(ValueError, match="rounds=0"):
        turn_order(["jax"], 0)


def test_spread_of_repeats():
    assert spread_of([3.0, 1.0, 2.0]) == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "repeats": 3}
    with pytest.raises(ValueError, match="at least one"):
        spread_of([])


def test_limit_cpus_pins_the_process_and_refuses_more_cpus_than_allowed():
    # In a child: the pin outlives the call, and this test process must keep its CPUs.
    code = ("import json, os; from benchmarks.cpu_limit import limit_cpus; chosen = limit_cpus(1); "
            "print(json.dumps([chosen, sorted(os.sched_getaffinity(0))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    chosen, now = json.loads(out.stdout.strip().splitlines()[-1])
    assert chosen == now == [min(os.sched_getaffinity(0))]
    from benchmarks.cpu_limit import limit_cpus

    with pytest.raises(ValueError, match="threads=0 is invalid"):
        limit_cpus(0)
    with pytest.raises(ValueError, match="is invalid"):
        limit_cpus(len(os.sched_getaffinity(0)) + 1)


@pytest.mark.slow
def test_hf_variants_hold_the_same_weights_and_compute_the_same_loss_and_gradients():
    torch = pytest.importorskip("torch")
    import jax

    from benchmarks.hf_variants import check_variants
    from benchmarks.train_step_vs_hf import CONFIGS, hf_model, token_batches
    from glm5_jax.model.transformer import init

    with pytest.raises(ValueError, match="flash"):
        check_variants(["eager", "flash"])
    config = CONFIGS["tiny"]
    params = jax.device_get(init(config, jax.random.key(0)))
    ids = torch.from_numpy(token_batches(config, 2, 64, 1, 1)[0]).long()
    losses, grads = {}, {}
    for variant in ("eager", "sdpa", "sdpa_checkpointed"):
        model = hf_model(params, config, variant)
        assert model.config._attn_implementation == variant.split("_")[0]
        assert model.is_gradient_checkpointing == variant.endswith("checkpointed")
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[variant] = float(loss.detach())
        grads[variant] = model.model.layers[0].self_attn.q_a_proj.weight.grad.numpy().copy()
    for variant in ("sdpa", "sdpa_checkpointed"):
        assert losses[variant] == pytest.approx(losses["eager"], rel=1e-5)
        np.testing.assert_allclose(grads[variant], grads["eager"], rtol=1e-4, atol=1e-6)
