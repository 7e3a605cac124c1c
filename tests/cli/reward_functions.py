"""Reward functions the rollout tests name with --reward tests.cli.reward_functions:NAME."""


def fails_on_second_prompt(text: str, record: dict) -> float:
    if record["id"] == "second":
        raise KeyError("answer")
    return float(len(text) % 2)
