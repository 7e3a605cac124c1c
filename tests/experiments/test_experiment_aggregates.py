"""Each experiment's aggregate.py: per-seed result files -> mean, min-max and paired differences over seeds
(synthetic result files with known figures, so every number below is computed by hand)."""

import json

import pytest

from experiments.chat_sft import aggregate as chat_sft
from experiments.dsa_continued_pretraining import aggregate as dsa
from experiments.rl_async import aggregate as rl_async


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _rl_rows(reward: float, accuracy: float, masked: float) -> list[dict]:
    rows = []
    for step in range(1, 101):
        row = {"step": step, "staleness": step % 4, "reward_mean": reward, "masked_frac": masked,
               "would_mask_frac": masked, "mismatch_k3_kl": 0.01 * (step % 4), "dropped_stale": 3072}
        if step == 1 or step % 10 == 0:
            row["greedy_accuracy"] = accuracy + (0.1 if step == 100 else 0.0)
        rows.append(row)
    return rows


def test_rl_async_summary_over_seeds(tmp_path):
    # seed 0: the variants reach reward 0.3 / 0.2 / 0.4; seed 1: 0.5 / 0.5 / 0.5.
    rewards = {0: (0.3, 0.2, 0.4), 1: (0.5, 0.5, 0.5)}
    for seed, per_variant in rewards.items():
        folder = tmp_path / f"seed_{seed}"
        folder.mkdir()
        for variant, reward in zip(rl_async.VARIANTS, per_variant):
            _write_jsonl(folder / f"{variant}.jsonl", _rl_rows(reward, accuracy=reward, masked=0.05 * (seed + 1)))
        (folder / "summary.json").write_text(json.dumps(
            {"sft": {"greedy_accuracy": 0.4 + 0.1 * seed, "final_loss": 0.3}, "total_wall_s": 100.0 + seed}))
    summary = rl_async.aggregate(tmp_path)
    assert summary["seeds"] == [0, 1]
    assert summary["sft_greedy_accuracy"]["mean"] == pytest.approx(0.45)
    tis = summary["variants"]["tis"]
    assert (tis["reward_81_100"]["min"], tis["reward_81_100"]["max"]) == (pytest.approx(0.4), pytest.approx(0.5))
    # the evaluations at 80, 90, 100: accuracy, accuracy, accuracy + 0.1
    assert tis["greedy_last_evals"]["per_seed"]["0"] == pytest.approx(0.4 + 0.1 / 3)
    assert tis["greedy_best"]["per_seed"]["1"] == pytest.approx(0.6)
    assert summary["variants"]["double_sided_is"]["masked_frac_staleness_2"]["mean"] == pytest.approx(0.075)
    assert summary["variants"]["double_sided_is"]["mismatch_k3_kl_max"]["mean"] == pytest.approx(0.03)
    paired = summary["paired_vs_no_is_correction"]
    assert set(paired) == {"double_sided_is", "tis"}
    assert paired["tis"]["reward_81_100"]["per_seed"] == {"0": pytest.approx(0.2), "1": pytest.approx(0.0)}
    assert paired["double_sided_is"]["reward_81_100"]["mean"] == pytest.approx(0.05)
    bands = rl_async.curve_bands(tmp_path)
    assert bands["reward"]["tis"]["min"][-1] == pytest.approx(0.4)
    assert bands["reward_minus_no_is_correction"]["tis"]["min"][-1] == pytest.approx(0.0)
    assert bands["reward_minus_no_is_correction"]["tis"]["max"][-1] == pytest.approx(0.2)
    assert bands["greedy_accuracy"]["tis"]["step"] == [1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]


def _dsa_seed(folder, *, dense: float, untrained: float, warmed: float, sparse: float, control: float, gap: float):
    folder.mkdir()
    evals = {"dense_pretrain_dense": dense, "dense_pretrain_top64_untrained_indexer": untrained,
             "after_warmup_top64": warmed, "dsa_sparse_top64": sparse, "dense_control_dense": control,
             "dense_control_top64_untrained_indexer": untrained}
    (folder / "summary.json").write_text(json.dumps({"eval": {k: {"eval_loss": v} for k, v in evals.items()}}))
    _write_jsonl(folder / "dense_pretrain_metrics.jsonl", [{"step": s, "lm_loss": 5.0 - s / 40} for s in range(1, 81)])
    _write_jsonl(folder / "warmup_metrics.jsonl",
                 [{"step": s, "indexer_kl": 1.0 / s, "topk_attention_mass": 0.5} for s in range(1, 31)])
    _write_jsonl(folder / "dense_control_metrics.jsonl", [{"step": s, "lm_loss": 2.5} for s in range(1, 31)])
    _write_jsonl(folder / "sparse_metrics.jsonl",
                 [{"step": s, "lm_loss": 2.5 + (2 * gap if s <= 5 else gap)} for s in range(1, 31)])


def test_dsa_summary_over_seeds(tmp_path):
    _dsa_seed(tmp_path / "seed_0", dense=2.3, untrained=2.4, warmed=2.35, sparse=2.32, control=2.30, gap=0.02)
    _dsa_seed(tmp_path / "seed_1", dense=2.4, untrained=2.6, warmed=2.45, sparse=2.41, control=2.40, gap=0.01)
    figures = dsa.aggregate(tmp_path)["figures"]
    assert figures["naive_top64_cost"]["per_seed"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.2)}
    # seed 0 recovers half of its 0.1 cost, seed 1 three quarters of its 0.2
    assert figures["warmup_recovered_fraction"]["per_seed"] == {"0": pytest.approx(0.5), "1": pytest.approx(0.75)}
    assert figures["dsa_minus_dense_control"]["mean"] == pytest.approx(0.015)
    assert figures["train_gap_first5"]["per_seed"]["0"] == pytest.approx(0.04)
    assert figures["train_gap_last10"]["per_seed"]["1"] == pytest.approx(0.01)
    assert figures["train_gap_mean"]["per_seed"]["0"] == pytest.approx((5 * 0.04 + 25 * 0.02) / 30)
    assert figures["warmup_indexer_kl_last5"]["mean"] == pytest.approx(sum(1 / s for s in range(26, 31)) / 5)
    bands = dsa.curve_bands(tmp_path)["sparse_vs_dense_loss"]
    assert bands["DSA sparse adaptation (top-64)"]["max"][0] == pytest.approx(2.54)
    gap = dsa.curve_bands(tmp_path)["sparse_minus_dense_loss"]["DSA minus dense control"]
    assert (gap["min"][-1], gap["max"][-1]) == (pytest.approx(0.01), pytest.approx(0.02))


def _chat_eval(right_marker: float, p_wrong: float) -> dict:
    turn = {"turns": 10, "stopped": 1.0, "right_marker": right_marker, "right_kind": right_marker, "exact": 0.1}
    return {"turn_ending": {"all": turn, "tool_call": turn, "answer": turn},
            "error_imitation": {"p_correct_operator": 1 - p_wrong, "p_wrong_operators": p_wrong,
                                "greedy_wrong_rate": p_wrong, "sampled_wrong_op_rate": 0.5,
                                "sampled_calls": {"correct_op": 3, "wrong_op": 3, "other": 4}}}


def test_chat_sft_summary_and_masking_effect(tmp_path):
    p_wrong = {0: (0.4, 0.6), 1: (0.5, 0.55)}  # (masked, control)
    for seed, (masked, control) in p_wrong.items():
        folder = tmp_path / f"seed_{seed}"
        folder.mkdir()
        (folder / "masked_eval.json").write_text(json.dumps(_chat_eval(0.9, masked)))
        (folder / "unmasked_eval.json").write_text(json.dumps(_chat_eval(0.8, control)))
        for run in chat_sft.RUNS:
            _write_jsonl(folder / f"{run}_metrics.jsonl",
                         [{"step": s, "lm_loss": 3.0 / s + seed} for s in (1, 2)]
                         + [{"step": s, "lm_loss": s / 10 + seed} for s in range(11, 21)])
    summary = chat_sft.aggregate(tmp_path)
    assert summary["runs"]["unmasked"]["p_wrong_operators"]["mean"] == pytest.approx(0.575)
    effect = summary["masked_minus_unmasked"]["p_wrong_operators"]
    assert (effect["min"], effect["max"]) == (pytest.approx(-0.2), pytest.approx(-0.05))
    assert summary["masked_minus_unmasked"]["turn_ending_answer_right_marker"]["mean"] == pytest.approx(0.1)
    assert summary["runs"]["masked"]["sampled_parsable_calls"]["mean"] == 6
    # steps 11-20 are covered (mean of s / 10 + seed: 1.55, 2.55), the later windows are not
    window = summary["runs"]["masked"]["train_loss_steps_11-20"]
    assert (window["min"], window["max"]) == (pytest.approx(1.55), pytest.approx(2.55))
    assert "train_loss_steps_111-120" not in summary["runs"]["masked"]
    loss = chat_sft.curve_bands(tmp_path)["train_loss"]["masked"]
    assert loss["step"][:2] == [1, 2] and loss["mean"][:2] == [3.5, 2.0] and loss["max"][:2] == [4.0, 2.5]


def test_chat_sft_tables_print_both_runs_and_the_paired_effect(tmp_path):
    from experiments.chat_sft import tables

    test_chat_sft_summary_and_masking_effect(tmp_path)
    summary = chat_sft.aggregate(tmp_path)
    lines = tables.table(summary, tables.IMITATION_ROWS + tables.LOSS_ROWS)
    wrong = next(line for line in lines if line.startswith("| P(either wrong operator)"))
    # masked 0.4 / 0.5, control 0.6 / 0.55, effect -0.2 / -0.05, each as mean (min-max) [per seed]
    assert wrong.split(" | ")[1:] == ["0.450 (0.400-0.500) [0.400, 0.500]", "0.575 (0.550-0.600) [0.600, 0.550]",
                                      "-0.125 (-0.200--0.050) [-0.200, -0.050] |"]
    assert any(line.startswith("| training loss, steps 11-20") for line in lines)
    assert not any("steps 111-120" in line for line in lines)  # a window no seed covers is left out


def test_plots_write_one_png_per_figure(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the experiments extra: pip install -e '.[experiments]'")
    from experiments.chat_sft import plots

    test_chat_sft_summary_and_masking_effect(tmp_path)
    (written,) = plots.main([str(tmp_path)])
    assert written == tmp_path / "train_loss.png" and written.read_bytes().startswith(b"\x89PNG")
