"""One JSON line per result: printed, and appended to a file when one is given (the GPU check's output)."""

from __future__ import annotations

import json


def emit(check: str, row: dict, out: str | None) -> None:
    line = json.dumps({"check": check, **row})
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
