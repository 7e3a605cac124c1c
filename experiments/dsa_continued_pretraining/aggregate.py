"""Summarise DSA continued pre-training over seeds: results/seed_<n>/ -> results/summary.json.

    python experiments/dsa_continued_pretraining/aggregate.py [experiments/dsa_continued_pretraining/results]

Per seed: the held-out loss of every stage (evaluate_dsa.py), and the figures the README's claims rest on,
each a difference within one seed (same validation batches, same training batches): what naive top-64 costs
the dense model, the share of that cost the warm-up recovers, the DSA model's gap to the dense control, and the
paired training-loss gap over the 30 shared batches. Each is reported as mean, min and max over seeds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from experiments.seeds import band, read_jsonl, seed_dirs, spread

STAGES = ("dense_pretrain", "warmup", "sparse", "dense_control")
WINDOW = 5


def seed_figures(results: Path) -> dict[str, float]:
    """The scalar figures of one seed's folder."""
    evaluated = json.loads((results / "summary.json").read_text())["eval"]
    evals = {name: entry["eval_loss"] for name, entry in evaluated.items()}
    dense = evals["dense_pretrain_dense"]
    naive_cost = evals["dense_pretrain_top64_untrained_indexer"] - dense
    warmup_drop = evals["after_warmup_top64"] - dense
    figures = {f"eval_{name}": loss for name, loss in evals.items()}
    figures.update({
        "naive_top64_cost": naive_cost,
        "warmup_drop": warmup_drop,
        "warmup_recovered_fraction": 1.0 - warmup_drop / naive_cost,
        "dsa_minus_dense_control": evals["dsa_sparse_top64"] - evals["dense_control_dense"],
    })
    sparse = {r["step"]: r["lm_loss"] for r in read_jsonl(results / "sparse_metrics.jsonl")}
    control = {r["step"]: r["lm_loss"] for r in read_jsonl(results / "dense_control_metrics.jsonl")}
    paired = [sparse[step] - control[step] for step in sorted(sparse)]
    figures.update({"train_gap_mean": statistics.fmean(paired), "train_gap_first5": statistics.fmean(paired[:WINDOW]),
                    "train_gap_last10": statistics.fmean(paired[-2 * WINDOW:])})
    warmup = read_jsonl(results / "warmup_metrics.jsonl")
    for key in ("indexer_kl", "topk_attention_mass"):
        values = [r[key] for r in warmup]
        figures[f"warmup_{key}_first5"] = statistics.fmean(values[:WINDOW])
        figures[f"warmup_{key}_last5"] = statistics.fmean(values[-WINDOW:])
    return figures


def aggregate(results: Path) -> dict:
    seeds = seed_dirs(results)
    per_seed = {seed: seed_figures(path) for seed, path in seeds.items()}
    names = per_seed[next(iter(seeds))]
    return {"seeds": list(seeds), "figures": {name: spread({s: per_seed[s][name] for s in seeds}) for name in names}}


def curve_bands(results: Path) -> dict[str, dict[str, dict]]:
    """{figure: {curve: band}}: pre-training loss, the warm-up's KL and top-k mass, sparse vs dense LM loss and
    their paired difference."""
    seeds = seed_dirs(results)
    rows = {seed: {stage: read_jsonl(path / f"{stage}_metrics.jsonl") for stage in STAGES}
            for seed, path in seeds.items()}

    def seed_curve(seed: int, stage: str, key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in rows[seed][stage] if key in r}

    def curves(stage: str, key: str) -> dict:
        return band({seed: seed_curve(seed, stage, key) for seed in seeds})

    def gap() -> dict:
        """DSA minus dense control, step by step on the same batches, seed by seed."""
        return band({seed: {step: loss - seed_curve(seed, "dense_control", "lm_loss")[step]
                            for step, loss in seed_curve(seed, "sparse", "lm_loss").items()} for seed in seeds})

    return {
        "pretrain_loss": {"dense pre-training": curves("dense_pretrain", "lm_loss")},
        "warmup_indexer_kl": {"indexer KL": curves("warmup", "indexer_kl")},
        "warmup_topk_mass": {"attention mass in the indexer's top-64": curves("warmup", "topk_attention_mass")},
        "sparse_vs_dense_loss": {"DSA sparse adaptation (top-64)": curves("sparse", "lm_loss"),
                                 "dense control": curves("dense_control", "lm_loss")},
        "sparse_minus_dense_loss": {"DSA minus dense control": gap()},
    }


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    (results / "summary.json").write_text(json.dumps(aggregate(results), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
