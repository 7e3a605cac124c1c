"""Curves per variant with the seed band (mean line, min-max shading), written as PNG. Needs matplotlib:
pip install -e '.[experiments]'."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402


def plot_bands(path: Path, bands: dict[str, dict[str, list[float]]], *, title: str, ylabel: str,
               xlabel: str = "step", seeds: int | None = None, reference: float | None = None) -> Path:
    """One line per variant (the mean over seeds) with its min-max band; `bands` maps a variant to
    experiments.seeds.band() output. `reference` draws a horizontal line (0 for a difference)."""
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    if reference is not None:
        axes.axhline(reference, color="black", linewidth=0.8)
    for name, curve in bands.items():
        line, = axes.plot(curve["step"], curve["mean"], label=name, linewidth=1.6)
        axes.fill_between(curve["step"], curve["min"], curve["max"], color=line.get_color(), alpha=0.2, linewidth=0)
    band_note = "" if not seeds else "\none seed" if seeds == 1 else f"\nmean of {seeds} seeds, band = min-max"
    axes.set_title(title + band_note, fontsize=10)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
