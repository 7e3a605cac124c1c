"""The Hugging Face settings a comparison runs and reports side by side: the attention implementation
(`eager`, or torch's `sdpa`) and, for training, gradient checkpointing (HF's own memory saver, the counterpart of
glm5_jax's per-layer remat). Child side only: imports torch and transformers, no jax."""

from __future__ import annotations

from benchmarks.hf_reference import load_model

# name -> (attn_implementation, gradient checkpointing)
HF_VARIANTS = {
    "eager": ("eager", False),
    "sdpa": ("sdpa", False),
    "eager_checkpointed": ("eager", True),
    "sdpa_checkpointed": ("sdpa", True),
}


def check_variants(names: list[str]) -> list[str]:
    unknown = [name for name in names if name not in HF_VARIANTS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"HF variants {names} are invalid: give distinct names from {list(HF_VARIANTS)}")
    return names


def load_variant(weights_dir: str, variant: str, threads: int):
    """GlmMoeDsaForCausalLM with the exported weights, set up as `variant` says."""
    attention, checkpointed = HF_VARIANTS[check_variants([variant])[0]]
    model = load_model(weights_dir, attention, threads)
    if checkpointed:
        enable_checkpointing(model)
    return model


def enable_checkpointing(model) -> None:
    """HF's activation (gradient) checkpointing: each decoder layer is recomputed in the backward. Non-reentrant,
    the form torch recommends."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
