"""Summarise the asynchronous RL experiment over seeds: results/seed_<n>/<variant>.jsonl -> results/summary.json.

    python experiments/rl_async/aggregate.py [experiments/rl_async/results]

Every figure is reported as its mean, min and max over seeds with the per-seed values. The endpoint figures
(sampled reward over all 100 steps and over the last 20, greedy accuracy averaged over the evaluations at
steps 80-100) are
also given as paired differences against `no_is_correction`: each seed's variants start from the same SFT
weights and see the same prompts, so the difference within a seed is the effect, and its spread over seeds
is what it is judged against.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from experiments.seeds import band, paired_spread, read_jsonl, rolling_mean, seed_dirs, spread

VARIANTS = ("double_sided_is", "no_is_correction", "tis")
BASELINE = "no_is_correction"
WINDOWS = ((1, 20), (21, 40), (41, 60), (61, 80), (81, 100))
LAST_EVALS = (80, 90, 100)
REWARD_SMOOTHING = 10
PAIRED_FIGURES = ("reward_all_steps", "reward_81_100", "greedy_last_evals")


def _mean(rows: list[dict], key: str, keep) -> float | None:
    values = [r[key] for r in rows if keep(r)]
    return statistics.fmean(values) if values else None


def seed_figures(rows: list[dict]) -> dict[str, float]:
    """The scalar figures of one variant's run (one seed)."""
    evals = {r["step"]: r["greedy_accuracy"] for r in rows if "greedy_accuracy" in r}
    figures = {f"reward_{a}_{b}": _mean(rows, "reward_mean", lambda r, a=a, b=b: a <= r["step"] <= b)
               for a, b in WINDOWS}
    figures["reward_all_steps"] = _mean(rows, "reward_mean", lambda r: True)
    figures.update({f"greedy_step_{step}": accuracy for step, accuracy in evals.items()})
    figures["greedy_last_evals"] = statistics.fmean(evals[s] for s in LAST_EVALS)
    figures["greedy_best"] = max(evals.values())
    for key in ("masked_frac", "would_mask_frac"):
        figures[f"{key}_mean"] = _mean(rows, key, lambda r: True)
        for lag in range(4):
            figures[f"{key}_staleness_{lag}"] = _mean(rows, key, lambda r, lag=lag: r["staleness"] == lag)
    kl = sorted(r["mismatch_k3_kl"] for r in rows)
    figures["mismatch_k3_kl_median"] = statistics.median(kl)
    figures["mismatch_k3_kl_max"] = kl[-1]
    figures["dropped_stale"] = float(rows[-1]["dropped_stale"])
    return figures


def aggregate(results: Path) -> dict:
    seeds = seed_dirs(results)
    rows = {seed: {v: read_jsonl(path / f"{v}.jsonl") for v in VARIANTS} for seed, path in seeds.items()}
    runs = {seed: json.loads((path / "summary.json").read_text()) for seed, path in seeds.items()}
    per_seed = {v: {seed: seed_figures(rows[seed][v]) for seed in seeds} for v in VARIANTS}

    def over_seeds(variant: str) -> dict:
        names = per_seed[variant][next(iter(seeds))]
        return {name: spread({seed: per_seed[variant][seed][name] for seed in seeds})
                for name in names if all(per_seed[variant][s][name] is not None for s in seeds)}

    summary = {
        "seeds": list(seeds),
        "sft_greedy_accuracy": spread({seed: runs[seed]["sft"]["greedy_accuracy"] for seed in seeds}),
        "sft_final_loss": spread({seed: runs[seed]["sft"]["final_loss"] for seed in seeds}),
        "wall_s_per_seed": {str(seed): runs[seed]["total_wall_s"] for seed in seeds},
        "variants": {v: over_seeds(v) for v in VARIANTS},
        "paired_vs_" + BASELINE: {
            v: {name: paired_spread({s: per_seed[v][s][name] for s in seeds},
                                    {s: per_seed[BASELINE][s][name] for s in seeds})
                for name in PAIRED_FIGURES}
            for v in VARIANTS if v != BASELINE},
    }
    return summary


def curve_bands(results: Path) -> dict[str, dict[str, dict]]:
    """{figure: {variant: band}} for the plots: smoothed sampled reward, its paired difference from the baseline,
    greedy accuracy, (would-)mask fraction."""
    seeds = seed_dirs(results)
    rows = {seed: {v: read_jsonl(path / f"{v}.jsonl") for v in VARIANTS} for seed, path in seeds.items()}

    def seed_curve(seed: int, variant: str, key: str, smooth: int) -> dict[int, float]:
        curve = {r["step"]: r[key] for r in rows[seed][variant] if key in r}
        return rolling_mean(curve, smooth) if smooth else curve

    def curves(variant: str, key: str, smooth: int = 0) -> dict:
        return band({seed: seed_curve(seed, variant, key, smooth) for seed in seeds})

    def paired(variant: str) -> dict:
        """The variant's smoothed reward minus the baseline's, seed by seed (same start, same prompts)."""
        return band({seed: {step: value - seed_curve(seed, BASELINE, "reward_mean", REWARD_SMOOTHING)[step]
                            for step, value in seed_curve(seed, variant, "reward_mean", REWARD_SMOOTHING).items()}
                     for seed in seeds})

    return {
        "reward": {v: curves(v, "reward_mean", REWARD_SMOOTHING) for v in VARIANTS},
        "reward_minus_no_is_correction": {v: paired(v) for v in VARIANTS if v != BASELINE},
        "greedy_accuracy": {v: curves(v, "greedy_accuracy") for v in VARIANTS},
        "mask_fraction": {"double_sided_is (masked)": curves("double_sided_is", "masked_frac", REWARD_SMOOTHING),
                          "no_is_correction (would mask)": curves(BASELINE, "would_mask_frac", REWARD_SMOOTHING)},
    }


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    summary = aggregate(results)
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
