"""Public entry points for generation (the implementation lives in `glm5_jax.generation`).

    out = generate(params, prompt_id_lists, config=cfg, sampling=SamplingParams(temperature=1.0, eos_ids=eos))
    out = speculative_generate(params, prompt_id_lists, config=cfg, sampling=..., num_draft=3)
    records = to_rollout_records(out, rollout_ids=..., group_ids=..., rewards=..., weight_versions=version)
"""

from glm5_jax.generation import *  # noqa: F401,F403  (this module is the documented entry point)
from glm5_jax.generation import __all__  # noqa: F401
