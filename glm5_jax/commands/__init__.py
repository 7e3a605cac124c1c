"""The work behind `glm5 generate`, `glm5 eval` and `glm5 rollout` (argument parsing stays in `cli.py`):
`source.py` (what a model is read from), `prompts.py`, `generate.py`, `evaluate.py`, `rollout.py`."""
