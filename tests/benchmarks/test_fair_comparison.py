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


def test_long_context_pools_rounds_and_reports_each_hf_variant():
    from benchmarks.long_context_vs_hf import parse_args, pooled_record, row_for, summary

    gib = 2**30
    jax_rounds = [{"status": "ok", "step_times_s": [2.0, 4.0], "first_step_s": 30.0, "first_loss": 9.1,
                   "peak_rss_bytes": 3 * gib},
                  {"status": "ok", "step_times_s": [3.0, 5.0], "first_step_s": 31.0, "first_loss": 9.1,
                   "peak_rss_bytes": 4 * gib}]
    jax_record = pooled_record(jax_rounds, 2048)
    assert jax_record["step_s"] == {"median_s": 3.5, "min_s": 2.0, "max_s": 5.0, "repeats": 4}
    assert jax_record["round_median_step_s"] == [3.0, 4.0] and jax_record["peak_rss_gib"] == 4.0
    assert jax_record["tokens_per_s"] == round(2048 / 3.5, 1)
    eager = pooled_record([{"status": "ok", "step_times_s": [7.0, 7.0], "first_step_s": 8.0, "first_loss": 9.1,
                            "peak_rss_bytes": 8 * gib},
                           {"status": "does_not_fit", "cap_gib": 20.0, "peak_rss_bytes": 20 * gib}], 2048)
    assert eager["status"] == "does_not_fit" and eager["rounds_ok"] == 1
    checkpointed = pooled_record([{"status": "ok", "step_times_s": [7.0], "first_step_s": 8.0, "first_loss": 9.1,
                                   "peak_rss_bytes": 2 * gib}], 2048)
    row = row_for(2048, jax_record, {"eager": eager, "sdpa_checkpointed": checkpointed})
    assert row["ratio_tokens_per_s"] == {"sdpa_checkpointed": 2.0}
    assert row["ratio_peak_rss"] == {"sdpa_checkpointed": 2.0}
    args = parse_args(["--seqs", "2048", "--threads", "1"])
    assert args.hf_variants == ["eager", "sdpa_checkpointed"] and args.rounds == 2
    out = summary([row], args)
    assert out["hf"]["eager"]["first_seq_not_fitting"] == 2048
    assert out["hf"]["sdpa_checkpointed"]["first_seq_not_fitting"] is None


def test_decode_takes_decode_time_pair_by_pair_over_rounds():
    from benchmarks.decode_vs_hf import parse_args, pooled_record

    gib = 2**30
    rounds = [{"status": "ok", "prefill_times_s": [1.0, 1.2], "full_times_s": [11.0, 13.2], "warmup_s": 40.0,
               "cache_bytes_per_token_per_layer": 896.0, "peak_rss_bytes": gib},
              {"status": "ok", "prefill_times_s": [1.1, 0.9], "full_times_s": [12.1, 11.9], "warmup_s": 41.0,
               "cache_bytes_per_token_per_layer": 896.0, "peak_rss_bytes": 2 * gib}]
    record = pooled_record(rounds, batch=2, prompt_len=100, new_tokens=11)
    assert record["decode_s"] == {"median_s": 11.0, "min_s": 10.0, "max_s": 12.0, "repeats": 4}
    assert record["decode_tokens_per_s"] == round(2 * 10 / 11.0, 1)
    assert record["round_decode_median_s"] == [11.0, 11.0] and record["peak_rss_gib"] == 2.0
    assert record["cache_bytes_per_token_per_layer"] == 896.0 and record["warmup_s"] == [40.0, 41.0]
    args = parse_args(["--threads", "1"])
    assert args.hf_variants == ["eager", "sdpa"] and args.repeats == 2 and args.rounds == 2
