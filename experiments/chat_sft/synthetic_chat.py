"""Deterministic synthetic tool-use conversations for chat SFT (records {"id", "messages", "tools"}).

Each conversation: a user asks an arithmetic or capital-city question, the assistant reasons, calls a
calculator or lookup tool, reads the observation and answers; some continue with a follow-up question.
A share of them contain an erroneous assistant turn, marked "error": true: a calculator call with the wrong
operator, followed by its (wrong) result and a corrected call. Some user turns end in "/nothink", and the
reply to them has no reasoning. `python experiments/chat_sft/synthetic_chat.py OUT.jsonl --num-records N --seed S`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Sequence

CALCULATOR_TOOL = {
    "name": "calculator",
    "description": "Evaluate an integer arithmetic expression with +, - or *.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example 12 * 7"}},
        "required": ["expression"],
    },
}
LOOKUP_TOOL = {
    "name": "lookup_capital",
    "description": "Return the capital city of a country.",
    "parameters": {
        "type": "object",
        "properties": {"country": {"type": "string"}},
        "required": ["country"],
    },
}
TOOLS = [CALCULATOR_TOOL, LOOKUP_TOOL]

CAPITALS = {
    "Canada": "Ottawa",
    "Chile": "Santiago",
    "Egypt": "Cairo",
    "France": "Paris",
    "Ghana": "Accra",
    "India": "New Delhi",
    "Italy": "Rome",
    "Japan": "Tokyo",
    "Kenya": "Nairobi",
    "Norway": "Oslo",
    "Peru": "Lima",
    "Spain": "Madrid",
}
OPERATORS = {
    "+": ("plus", lambda a, b: a + b),
    "-": ("minus", lambda a, b: a - b),
    "*": ("times", lambda a, b: a * b),
}
ARITHMETIC_QUESTIONS = ("What is {a} {word} {b}?", "Compute {a} {op} {b}.", "How much is {a} {word} {b}?")
CAPITAL_QUESTIONS = ("What is the capital of {country}?", "Which city is the capital of {country}?")
FOLLOW_UPS = ("And what is the capital of {country}?", "Thanks. Now, the capital of {country}?")
NO_THINK_SUFFIX = " /nothink"


def _tool_call(name: str, **arguments: str) -> dict:
    return {"name": name, "arguments": arguments}


def _assistant(
    reasoning: str | None, content: str = "", tool_calls: Sequence[dict] = (), error: bool = False
) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    if error:
        message["error"] = True
    return message


def _arithmetic_exchange(rng: random.Random, thinking: bool, with_error: bool) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(sorted(OPERATORS))
    word, apply = OPERATORS[op]
    question = rng.choice(ARITHMETIC_QUESTIONS).format(a=a, b=b, op=op, word=word)
    expression = f"{a} {op} {b}"
    result = apply(a, b)
    messages = [{"role": "user", "content": question + ("" if thinking else NO_THINK_SUFFIX)}]

    def think(text: str) -> str | None:
        return text if thinking else None

    if with_error:
        wrong_op = rng.choice(sorted(set(OPERATORS) - {op}))
        wrong_word, wrong_apply = OPERATORS[wrong_op]
        messages += [
            _assistant(
                think(f"The user wants {a} {wrong_word} {b}. I will use the calculator."),
                tool_calls=[_tool_call("calculator", expression=f"{a} {wrong_op} {b}")],
                error=True,
            ),
            {"role": "observation", "content": str(wrong_apply(a, b))},
            _assistant(
                think(f"That call used {wrong_op}, but the question asks for {a} {word} {b}. Calling again."),
                tool_calls=[_tool_call("calculator", expression=expression)],
            ),
        ]
    else:
        messages.append(
            _assistant(
                think(f"The user wants {a} {word} {b}. I will use the calculator."),
                tool_calls=[_tool_call("calculator", expression=expression)],
            )
        )
    messages += [
        {"role": "observation", "content": str(result)},
        _assistant(think(f"The calculator returned {result}."), content=f"{a} {word} {b} is {result}."),
    ]
    return messages


def _capital_exchange(rng: random.Random, thinking: bool, questions: Sequence[str]) -> list[dict]:
    country = rng.choice(sorted(CAPITALS))
    capital = CAPITALS[country]
    question = rng.choice(questions).format(country=country)
    return [
        {"role": "user", "content": question + ("" if thinking else NO_THINK_SUFFIX)},
        _assistant(
            f"I should look up the capital of {country}." if thinking else None,
            tool_calls=[_tool_call("lookup_capital", country=country)],
        ),
        {"role": "observation", "content": capital},
        _assistant(
            f"The lookup says {capital}." if thinking else None,
            content=f"The capital of {country} is {capital}.",
        ),
    ]


def generate_records(
    num_records: int, seed: int = 0, *, error_fraction: float = 0.25, no_think_fraction: float = 0.1
) -> list[dict]:
    """`num_records` conversations, identical for identical arguments."""
    if not isinstance(num_records, int) or num_records < 0:
        raise ValueError(f"num_records must be a non-negative int, got {num_records!r}")
    for name, fraction in (("error_fraction", error_fraction), ("no_think_fraction", no_think_fraction)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {fraction!r}")
    rng = random.Random(seed)
    records = []
    for index in range(num_records):
        thinking = rng.random() >= no_think_fraction
        if rng.random() < error_fraction:
            messages = _arithmetic_exchange(rng, thinking, with_error=True)
        elif rng.random() < 0.5:
            messages = _arithmetic_exchange(rng, thinking, with_error=False)
        else:
            messages = _capital_exchange(rng, thinking, CAPITAL_QUESTIONS)
        if rng.random() < 0.3:
            messages += _capital_exchange(rng, thinking, FOLLOW_UPS)
        records.append({"id": f"synthetic-{seed}-{index}", "messages": messages, "tools": TOOLS})
    return records


def write_jsonl(records: Sequence[dict], path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output JSONL path")
    parser.add_argument("--num-records", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error-fraction", type=float, default=0.25)
    args = parser.parse_args(argv)
    write_jsonl(generate_records(args.num_records, args.seed, error_fraction=args.error_fraction), args.out)


if __name__ == "__main__":
    main()
