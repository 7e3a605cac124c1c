"""The README's tables, printed as markdown from results/ (so the figures there are copied, not retyped):
  python experiments/rl_async/tables.py [experiments/rl_async/results]"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

VARIANTS = ("double_sided_is", "no_is_correction", "tis")
WINDOWS = ((1, 20), (21, 40), (41, 60), (61, 80), (81, 100))


def _rows(results: Path, variant: str) -> list[dict]:
    return [json.loads(line) for line in (results / f"{variant}.jsonl").read_text().splitlines() if line.strip()]


def _mean(rows: list[dict], key: str, keep) -> float:
    return statistics.fmean(r[key] for r in rows if keep(r))


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    summary = json.loads((results / "summary.json").read_text())
    rows = {v: _rows(results, v) for v in VARIANTS}
    print(f"SFT: {summary['sft']['steps']} steps, greedy accuracy {summary['sft']['greedy_accuracy']:.3f}, "
          f"total wall {summary['total_wall_s']:.0f} s\n")
    print("| variant | " + " | ".join(f"{a}-{b}" for a, b in WINDOWS) + " |")
    print("|---|" + "---|" * len(WINDOWS))
    for v in VARIANTS:
        means = [_mean(rows[v], "reward_mean", lambda r, a=a, b=b: a <= r["step"] <= b) for a, b in WINDOWS]
        print(f"| {v} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    steps = [s for s, _ in summary[VARIANTS[0]]["greedy_accuracy"]]
    print("\n| variant | " + " | ".join(str(s) for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for v in VARIANTS:
        print(f"| {v} | " + " | ".join(f"{a:.2f}".lstrip("0") for _, a in summary[v]["greedy_accuracy"]) + " |")
    print("\n| | " + " | ".join(f"{a}-{b}" for a, b in WINDOWS) + " | staleness 0 | 1 | 2 | 3 |")
    print("|---|" + "---|" * (len(WINDOWS) + 4))
    for v, key, label in (("double_sided_is", "masked_frac", "masked"), ("no_is_correction", "would_mask_frac", "would")):
        by_window = [_mean(rows[v], key, lambda r, a=a, b=b: a <= r["step"] <= b) for a, b in WINDOWS]
        by_lag = [_mean(rows[v], key, lambda r, lag=lag: r["staleness"] == lag) for lag in range(4)]
        print(f"| {v} ({label}) | " + " | ".join(f"{100 * x:.1f}%" for x in by_window + by_lag) + " |")
    kl = {v: max(r["mismatch_k3_kl"] for r in rows[v]) for v in VARIANTS}
    print("\nlargest k3 mismatch KL per variant: " + ", ".join(f"{v} {x:.4f}" for v, x in kl.items()))
    print("dropped stale samples: " + ", ".join(f"{v} {summary[v]['dropped_stale']}" for v in VARIANTS))


if __name__ == "__main__":
    main(sys.argv[1:])
