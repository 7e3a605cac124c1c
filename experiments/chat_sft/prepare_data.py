"""Turn `experiments/chat_sft/synthetic_chat.py` output into the experiment's training files.

    python experiments/chat_sft/prepare_data.py IN.jsonl OUT.jsonl [--unmask-errors]

Drops the "tools" list: every record carries the same two tools, and their ~780-byte system block would make
each byte-tokenised conversation about 4x longer with nothing to learn from it. `--unmask-errors` removes the
"error" flags, so the erroneous turns are trained like any other (the control run).
"""

from __future__ import annotations

import argparse
import json


def prepare(records: list[dict], unmask_errors: bool) -> list[dict]:
    prepared = []
    for record in records:
        messages = [dict(message) for message in record["messages"]]
        if unmask_errors:
            for message in messages:
                message.pop("error", None)
        prepared.append({"id": record["id"], "messages": messages})
    return prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--unmask-errors", action="store_true")
    args = parser.parse_args()
    with open(args.source, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    with open(args.out, "w", encoding="utf-8") as handle:
        for record in prepare(records, args.unmask_errors):
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
