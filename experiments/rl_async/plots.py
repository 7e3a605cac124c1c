"""The README's figures as PNG from results/seed_<n>/ (mean over seeds, min-max band):
    python experiments/rl_async/plots.py [experiments/rl_async/results]"""

from __future__ import annotations

import sys
from pathlib import Path

from experiments.plots import plot_bands
from experiments.rl_async.aggregate import REWARD_SMOOTHING, curve_bands
from experiments.seeds import seed_dirs

LABELS = {
    "reward": (f"sampled reward (trailing mean of {REWARD_SMOOTHING} steps)", "async RL: sampled reward"),
    "reward_minus_no_is_correction": ("reward minus no_is_correction (same seed)",
                                      f"async RL: sampled reward minus no_is_correction's (trailing mean of {REWARD_SMOOTHING})"),
    "greedy_accuracy": ("greedy accuracy, 128 held-out prompts", "async RL: greedy accuracy"),
    "mask_fraction": (f"fraction outside (0.8, 1.2) (trailing mean of {REWARD_SMOOTHING})",
                      "async RL: tokens outside the IS band"),
}


def main(argv: list[str]) -> list[Path]:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    seeds = len(seed_dirs(results))
    written = []
    for figure, bands in curve_bands(results).items():
        ylabel, title = LABELS[figure]
        reference = 0.0 if figure == "reward_minus_no_is_correction" else None
        written.append(plot_bands(results / f"{figure}.png", bands, title=title, ylabel=ylabel, xlabel="trainer step",
                                  seeds=seeds, reference=reference))
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
