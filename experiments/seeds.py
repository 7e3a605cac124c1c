"""Figures over seeds: find the per-seed result folders (results/seed_<n>/), summarise a figure as its mean and
min-max over seeds, and stack per-step curves into a mean and a band. Used by each experiment's aggregation;
plotting lives in experiments/plots.py (matplotlib is the `experiments` extra, not a core dependency)."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

SEED_DIR = re.compile(r"seed_(\d+)")


def seed_dirs(results: Path) -> dict[int, Path]:
    """{seed: folder} for every results/seed_<n>/ folder, in seed order; an error when there is none."""
    found = {int(m.group(1)): p for p in Path(results).iterdir() if p.is_dir() and (m := SEED_DIR.fullmatch(p.name))}
    if not found:
        raise FileNotFoundError(f"{results} holds no seed_<n>/ folder: run the experiment's run.sh first")
    return dict(sorted(found.items()))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def spread(values_by_seed: dict[int, float]) -> dict:
    """Mean, min, max and the per-seed values of one figure (None values, e.g. a metric a run does not
    report, are an error: a figure must exist for every seed it is summarised over)."""
    if not values_by_seed:
        raise ValueError("spread() needs at least one seed's value")
    missing = [seed for seed, value in values_by_seed.items() if value is None or not math.isfinite(value)]
    if missing:
        raise ValueError(f"seeds {missing} have no finite value for this figure: {values_by_seed}")
    values = list(values_by_seed.values())
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values),
            "per_seed": {str(seed): value for seed, value in values_by_seed.items()}}


def paired_spread(a: dict[int, float], b: dict[int, float]) -> dict:
    """spread() of a - b seed by seed (the two must have the same seeds): the difference a change makes
    within a seed, against how much that difference moves between seeds."""
    if set(a) != set(b):
        raise ValueError(f"paired figures need the same seeds: {sorted(a)} vs {sorted(b)}")
    return spread({seed: a[seed] - b[seed] for seed in a})


def band(curves_by_seed: dict[int, dict[int, float]]) -> dict[str, list[float]]:
    """Stack {seed: {step: value}} curves over the steps every seed has: {"step", "mean", "min", "max"}."""
    if not curves_by_seed:
        raise ValueError("band() needs at least one seed's curve")
    steps = sorted(set.intersection(*(set(curve) for curve in curves_by_seed.values())))
    columns = [[curve[step] for curve in curves_by_seed.values()] for step in steps]
    return {"step": steps, "mean": [statistics.fmean(c) for c in columns],
            "min": [min(c) for c in columns], "max": [max(c) for c in columns]}


def rolling_mean(curve: dict[int, float], window: int) -> dict[int, float]:
    """Trailing mean over the last `window` steps (noisy per-step metrics read better smoothed)."""
    steps = sorted(curve)
    return {step: statistics.fmean(curve[s] for s in steps[max(0, i - window + 1):i + 1])
            for i, step in enumerate(steps)}


def format_spread(figure: dict, digits: int = 3) -> str:
    """'0.412 (0.380-0.450)': the mean, then the min-max over seeds."""
    return f"{figure['mean']:.{digits}f} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"


def format_spread_and_seeds(figure: dict, digits: int = 3) -> str:
    """'0.412 (0.380-0.450) [0.380, 0.406, 0.450]': format_spread, then each seed's value in seed order."""
    per_seed = ", ".join(f"{value:.{digits}f}" for value in figure["per_seed"].values())
    return f"{format_spread(figure, digits)} [{per_seed}]"
