"""Reward functions for `glm5 rollout --reward glm5_jax.examples.rewards:NAME`.

A reward function is called once per sample as `function(text, record)`: `text` is the sampled completion
(decoded, without the final stop token) and `record` the prompt's JSON object as written in the prompts file
(so a task can carry its answer there). It returns a number; an exception stops the rollout naming the record.
"""

from __future__ import annotations


def python_line(text: str, record: dict) -> float:
    """1.0 when the prompt's last line completed with the sample's first line is one line of valid Python
    (a statement that needs no indented block), else 0.0: a syntax reward a code model can learn from.
    Prompts end mid-line, e.g. {"prompt": "def area(r):\\n    return "}."""
    line = record["prompt"].rsplit("\n", 1)[-1] + text.split("\n", 1)[0]
    if not line.strip() or line.rstrip().endswith(":"):
        return 0.0
    try:  # inside a function body, so that `return` and `yield` lines count
        compile("def sample():\n    " + line.strip(), "<rollout>", "exec")
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the sampled text
        return 0.0
    return 1.0


def contains_answer(text: str, record: dict) -> float:
    """1.0 when the record's "answer" string occurs in the completion, else 0.0."""
    answer = record["answer"]
    if not isinstance(answer, str) or not answer:
        raise ValueError(f"field 'answer' must be a non-empty string, got {answer!r}")
    return float(answer in text)
