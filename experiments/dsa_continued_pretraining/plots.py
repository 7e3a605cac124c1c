"""The README's figures as PNG from results/seed_<n>/ (mean over seeds, min-max band):
    python experiments/dsa_continued_pretraining/plots.py [experiments/dsa_continued_pretraining/results]"""

from __future__ import annotations

import sys
from pathlib import Path

from experiments.dsa_continued_pretraining.aggregate import curve_bands
from experiments.plots import plot_bands
from experiments.seeds import seed_dirs

LABELS = {
    "pretrain_loss": ("training LM loss (nats/byte)", "dense pre-training"),
    "warmup_indexer_kl": ("indexer KL (nats)", "dense warm-up: indexer KL to the attention"),
    "warmup_topk_mass": ("attention mass captured", "dense warm-up: attention mass in the top-64"),
    "sparse_vs_dense_loss": ("training LM loss (nats/byte), same batches", "sparse adaptation vs dense control"),
    "sparse_minus_dense_loss": ("DSA minus dense LM loss (nats/byte)", "sparse adaptation minus dense control, "
                                                                      "same batches and seed"),
}


def main(argv: list[str]) -> list[Path]:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    seeds = len(seed_dirs(results))
    return [plot_bands(results / f"{figure}.png", bands, title=LABELS[figure][1], ylabel=LABELS[figure][0],
                       seeds=seeds, reference=0.0 if figure == "sparse_minus_dense_loss" else None)
            for figure, bands in curve_bands(results).items()]


if __name__ == "__main__":
    main(sys.argv[1:])
