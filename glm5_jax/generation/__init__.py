"""Generation for rollouts: batched prefill + decode over a latent KV cache with DSA top-k, temperature /
top-p sampling with recorded logprobs and routing, MTP speculative decoding, and rollout records built
straight from token ids. Files: cache.py (the cache, and the model run over new tokens against it),
sampling.py, decode.py (plain generation), speculative.py (MTP drafting), records.py (token-in-token-out).
"""

from glm5_jax.generation.decode import GenerationOutput, generate
from glm5_jax.generation.records import to_rollout_records
from glm5_jax.generation.sampling import GenerationError, SamplingParams
from glm5_jax.generation.speculative import mean_acceptance_length, speculative_generate

__all__ = [
    "GenerationError",
    "GenerationOutput",
    "SamplingParams",
    "generate",
    "mean_acceptance_length",
    "speculative_generate",
    "to_rollout_records",
]
