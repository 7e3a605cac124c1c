"""The README's tables, printed as markdown from results/summary.json (written by aggregate.py), so the figures
there are copied, not retyped: mean over seeds, then the min-max in parentheses.
  python experiments/rl_async/tables.py [experiments/rl_async/results]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.rl_async.aggregate import BASELINE, LAST_EVALS, PAIRED_FIGURES, VARIANTS, WINDOWS
from experiments.seeds import format_spread


def main(argv: list[str]) -> None:
    results = Path(argv[0] if argv else Path(__file__).parent / "results")
    summary = json.loads((results / "summary.json").read_text())
    figures = summary["variants"]
    print(f"seeds {summary['seeds']}; SFT greedy accuracy {format_spread(summary['sft_greedy_accuracy'])}; "
          f"wall per seed (s) {summary['wall_s_per_seed']}\n")
    print("| variant | " + " | ".join(f"{a}-{b}" for a, b in WINDOWS) + " |")
    print("|---|" + "---|" * len(WINDOWS))
    for v in VARIANTS:
        print(f"| {v} | " + " | ".join(format_spread(figures[v][f"reward_{a}_{b}"]) for a, b in WINDOWS) + " |")
    steps = sorted(int(k.rsplit("_", 1)[1]) for k in figures[VARIANTS[0]] if k.startswith("greedy_step_"))
    print("\n| variant | " + " | ".join(str(s) for s in steps) + " | best |")
    print("|---|" + "---|" * (len(steps) + 1))
    for v in VARIANTS:
        cells = [figures[v][f"greedy_step_{s}"] for s in steps] + [figures[v]["greedy_best"]]
        print(f"| {v} | " + " | ".join(format_spread(c, 2).replace("0.", ".") for c in cells) + " |")
    print("\n| | mean | staleness 0 | 1 | 2 | 3 |")
    print("|---|---|---|---|---|---|")
    for v, key, label in (("double_sided_is", "masked_frac", "masked"), (BASELINE, "would_mask_frac", "would")):
        cells = [figures[v][f"{key}_mean"]] + [figures[v][f"{key}_staleness_{lag}"] for lag in range(4)]
        print(f"| {v} ({label}) | " + " | ".join(
            f"{100 * c['mean']:.1f}% ({100 * c['min']:.1f}-{100 * c['max']:.1f})" for c in cells) + " |")
    print(f"\nPaired difference against {BASELINE} (same seed, same SFT weights and prompts): mean (per seed)\n")
    print(f"| variant | reward, steps 1-100 | reward, steps 81-100 | greedy accuracy, mean of steps "
          f"{', '.join(map(str, LAST_EVALS))} |")
    print("|---|---|---|---|")
    for v, diff in summary[f"paired_vs_{BASELINE}"].items():
        cells = [f"{d['mean']:+.3f} (" + ", ".join(f"{x:+.3f}" for x in d["per_seed"].values()) + ")"
                 for d in (diff[name] for name in PAIRED_FIGURES)]
        print(f"| {v} | " + " | ".join(cells) + " |")
    corrected = [v for v in VARIANTS if v != BASELINE]  # the baseline overwrites its logprobs: KL 0
    kl = {v: format_spread(figures[v]["mismatch_k3_kl_median"], 4) for v in corrected}
    print("\nmedian k3 mismatch KL per variant: " + ", ".join(f"{v} {x}" for v, x in kl.items()))
    kl_max = {v: format_spread(figures[v]["mismatch_k3_kl_max"], 3) for v in corrected}
    print("largest k3 mismatch KL per variant: " + ", ".join(f"{v} {x}" for v, x in kl_max.items()))
    dropped = {v: format_spread(figures[v]["dropped_stale"], 0) for v in VARIANTS}
    print("dropped stale samples: " + ", ".join(f"{v} {x}" for v, x in dropped.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
