"""Summarise chat SFT over seeds: results/seed_<n>/{masked,unmasked}_eval.json -> results/summary.json.

    python experiments/chat_sft/aggregate.py [experiments/chat_sft/results]

Each figure of evaluate_sft.py for both runs (masked SFT and the control with the errors trained), and each run's
training loss over a few windows of steps, as mean, min and max over seeds; and the masking effect as a paired
difference (masked minus control, seed by seed: the two runs of a seed share initial weights, batch order and
held-out set).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from experiments.seeds import band, paired_spread, read_jsonl, seed_dirs, spread

RUNS = ("masked", "unmasked")
TURN_KEYS = ("stopped", "right_marker", "right_kind", "exact")
IMITATION_KEYS = ("p_correct_operator", "p_wrong_operators", "greedy_wrong_rate", "sampled_wrong_op_rate")
# Training-loss windows (first and last steps, both inclusive) the README quotes: early, the middle, the end.
LOSS_WINDOWS = ((11, 20), (111, 120), (231, 240))


def seed_figures(evaluation: dict) -> dict[str, float]:
    """The scalar figures of one run's evaluate_sft.py output."""
    figures = {f"turn_ending_{kind}_{key}": evaluation["turn_ending"][kind][key]
               for kind in ("all", "tool_call", "answer") for key in TURN_KEYS}
    figures.update({key: evaluation["error_imitation"][key] for key in IMITATION_KEYS})
    calls = evaluation["error_imitation"]["sampled_calls"]
    figures["sampled_parsable_calls"] = calls["correct_op"] + calls["wrong_op"]
    return figures


def loss_windows(metrics: list[dict]) -> dict[str, float]:
    """Mean training LM loss over each of LOSS_WINDOWS that the run covers, keyed "train_loss_steps_A-B"."""
    loss = {row["step"]: row["lm_loss"] for row in metrics}
    return {f"train_loss_steps_{first}-{last}": statistics.fmean(loss[s] for s in range(first, last + 1))
            for first, last in LOSS_WINDOWS if all(s in loss for s in range(first, last + 1))}


def aggregate(results: Path) -> dict:
    seeds = seed_dirs(results)
    per_seed = {run: {seed: {**seed_figures(json.loads((path / f"{run}_eval.json").read_text())),
                             **loss_windows(read_jsonl(path / f"{run}_metrics.jsonl"))}
                      for seed, path in seeds.items()} for run in RUNS}
    names = per_seed["masked"][next(iter(seeds))]

    def column(run: str, name: str) -> dict[int, float]:
        return {seed: per_seed[run][seed][name] for seed in seeds}

    return {"seeds": list(seeds),
            "runs": {run: {name: spread(column(run, name)) for name in names} for run in RUNS},
            "masked_minus_unmasked": {name: paired_spread(column("masked", name), column("unmasked", name))
                                      for name in names}}


def curve_bands(results: Path) -> dict[str, dict[str, dict]]:
    seeds = seed_dirs(results)
    return {"train_loss": {run: band({seed: {r["step"]: r["lm_loss"] for r in read_jsonl(path / f"{run}_metrics.jsonl")}
                                      for seed, path in seeds.items()}) for run in RUNS}}


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    (results / "summary.json").write_text(json.dumps(aggregate(results), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
