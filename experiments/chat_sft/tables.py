"""The README's tables, printed as markdown from results/summary.json (written by aggregate.py), so the figures
there are copied, not retyped: mean over seeds, then the min-max in parentheses and the per-seed values; the
last column is the paired masking effect (masked minus control, seed by seed).
  python experiments/chat_sft/tables.py [experiments/chat_sft/results]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.chat_sft.aggregate import LOSS_WINDOWS
from experiments.seeds import format_spread_and_seeds

TURN_ROWS = (
    ("turn_ending_all_stopped", "turns that end with a role marker / `<|endoftext|>` within the budget"),
    ("turn_ending_tool_call_right_marker", "tool-call turns ending with `<|observation|>` (the right marker)"),
    ("turn_ending_answer_right_kind", "answer turns ending with `<|user|>` or `<|endoftext|>` (the right kind)"),
    ("turn_ending_answer_right_marker", "answer turns ending with exactly the reference marker"),
    ("turn_ending_all_right_marker", "all turns ending with exactly the reference marker"),
    ("turn_ending_all_exact", "turns reproduced token for token, stop marker included"),
)
IMITATION_ROWS = (
    ("p_correct_operator", "P(correct operator) at the decision point (mean)"),
    ("p_wrong_operators", "P(either wrong operator) (mean)"),
    ("greedy_wrong_rate", "greedy choice is a wrong operator"),
    ("sampled_wrong_op_rate", "sampled calls with a wrong operator (of parsable calls)"),
    ("sampled_parsable_calls", "parsable sampled calculator calls (4 samples per question)"),
)
LOSS_ROWS = tuple((f"train_loss_steps_{a}-{b}", f"training loss, steps {a}-{b} (mean of 10 steps)")
                  for a, b in LOSS_WINDOWS)


def table(summary: dict, rows: tuple) -> list[str]:
    lines = ["| | masked SFT | control (errors trained) | masked minus control |", "|---|---:|---:|---:|"]
    runs, effect = summary["runs"], summary["masked_minus_unmasked"]
    for key, label in rows:
        digits = 0 if key == "sampled_parsable_calls" else 3  # a count
        if key in effect:
            cells = (format_spread_and_seeds(f[key], digits) for f in (runs["masked"], runs["unmasked"], effect))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    summary = json.loads((results / "summary.json").read_text())
    print(f"seeds {summary['seeds']}: mean (min-max) [per seed]\n")
    for rows in (TURN_ROWS, IMITATION_ROWS, LOSS_ROWS):
        print("\n".join(table(summary, rows)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
