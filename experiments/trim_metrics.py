"""Copy a run's metrics.jsonl keeping only the named fields (the ones an experiment's README cites):
    python experiments/trim_metrics.py SRC DST FIELD [FIELD ...]"""

import json
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(f"usage: trim_metrics.py SRC DST FIELD [FIELD ...] (got {argv})")
    src, dst, keep = argv[0], argv[1], argv[2:]
    with open(src) as rows, open(dst, "w") as out:
        for line in rows:
            row = json.loads(line)
            out.write(json.dumps({k: row[k] for k in keep if k in row}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
