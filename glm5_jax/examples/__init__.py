"""Small examples shipped with the package: reward functions for `glm5 rollout --reward module:function`
(`rewards.py`) and the prompts of the README walk-through (`python_prompts.jsonl`)."""
