"""The README's training-loss figure as PNG from results/seed_<n>/ (mean over seeds, min-max band):
    python experiments/chat_sft/plots.py [experiments/chat_sft/results]"""

from __future__ import annotations

import sys
from pathlib import Path

from experiments.chat_sft.aggregate import curve_bands
from experiments.plots import plot_bands
from experiments.seeds import seed_dirs


def main(argv: list[str]) -> list[Path]:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    seeds = len(seed_dirs(results))
    bands = curve_bands(results)["train_loss"]
    labelled = {"masked SFT": bands["masked"], "control (errors trained)": bands["unmasked"]}
    return [plot_bands(results / "train_loss.png", labelled, title="chat SFT: training loss",
                       ylabel="training loss on trained tokens (nats/token)", seeds=seeds)]


if __name__ == "__main__":
    main(sys.argv[1:])
