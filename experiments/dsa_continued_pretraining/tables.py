"""The README's tables, printed as markdown from results/summary.json (written by aggregate.py), so the figures
there are copied, not retyped: mean over seeds, then the min-max in parentheses and the per-seed values.
  python experiments/dsa_continued_pretraining/tables.py [experiments/dsa_continued_pretraining/results]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.seeds import format_spread_and_seeds

EVAL_ROWS = (
    ("dense_pretrain_dense", "dense pre-training, step 80", "dense (512)"),
    ("dense_pretrain_top64_untrained_indexer", "dense pre-training, step 80", "top-64, untrained indexer"),
    ("after_warmup_top64", "after the dense warm-up (indexer only, 30 steps)", "top-64"),
    ("dsa_sparse_top64", "**DSA: warm-up + 30 sparse steps**", "**top-64**"),
    ("dense_control_dense", "**dense control: 30 dense steps**", "**dense (512)**"),
    ("dense_control_top64_untrained_indexer", "dense control", "top-64, untrained indexer"),
)
DERIVED = (
    ("naive_top64_cost", "top-64 with the untrained indexer minus dense, pre-trained model (nats)"),
    ("warmup_drop", "after the warm-up, top-64 minus dense (nats)"),
    ("warmup_recovered_fraction", "share of the naive top-64 cost the warm-up recovers"),
    ("dsa_minus_dense_control", "**DSA minus dense control, held-out (nats)**"),
    ("train_gap_mean", "DSA minus dense control, training LM loss on the 30 shared batches (nats)"),
    ("train_gap_first5", "... its first 5 steps"),
    ("train_gap_last10", "... its last 10 steps"),
    ("warmup_indexer_kl_first5", "warm-up indexer KL, first 5 steps (nats)"),
    ("warmup_indexer_kl_last5", "warm-up indexer KL, last 5 steps (nats)"),
    ("warmup_topk_attention_mass_first5", "attention mass in the indexer's top-64, warm-up first 5 steps"),
    ("warmup_topk_attention_mass_last5", "attention mass in the indexer's top-64, warm-up last 5 steps"),
)


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    summary = json.loads((results / "summary.json").read_text())
    figures = summary["figures"]
    print(f"seeds {summary['seeds']}: mean (min-max) [per seed]\n")
    print("| parameters | attention at eval | eval loss | vs. dense control |")
    print("|---|---|---:|---:|")
    control = figures["eval_dense_control_dense"]
    for key, parameters, attention in EVAL_ROWS:
        figure = figures[f"eval_{key}"]
        gap = {s: v - control["per_seed"][s] for s, v in figure["per_seed"].items()}
        gap_cell = "" if key == "dense_control_dense" else f"{sum(gap.values()) / len(gap):+.4f}"
        print(f"| {parameters} | {attention} | {format_spread_and_seeds(figure, 4)} | {gap_cell} |")
    print("\n| figure | mean (min-max) [per seed] |")
    print("|---|---|")
    for key, label in DERIVED:
        print(f"| {label} | {format_spread_and_seeds(figures[key], 3)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
