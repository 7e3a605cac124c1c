"""The Hugging Face side of the long-context and decode benchmarks, kept free of jax so that a child process
measuring HF's peak memory does not also hold jax, XLA and glm5_jax.

`export_weights` (parent side, imports glm5_jax lazily) writes glm5_jax's initial parameters as an HF config
plus a safetensors file; `load_model` (child side: torch, transformers, safetensors only) builds
`GlmMoeDsaForCausalLM` from them. The weights transfer is `train_step_vs_hf.hf_model`'s: the config from
`glm5_jax.convert.hf.hf_config_dict`, the tensors from `to_hf_state_dict(fused_experts=True, include_mtp=False)`,
loaded with strict=True.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_ATTENTION = ("eager", "sdpa")
_DROPPED_CONFIG_KEYS = ("architectures", "model_type", "torch_dtype")


def export_weights(params, config, directory: str | Path) -> Path:
    """Write hf_config.json and model.safetensors for `params` (a glm5_jax tree) under `directory`."""
    from safetensors.numpy import save_file

    from glm5_jax.convert.hf import hf_config_dict, to_hf_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in hf_config_dict(config).items() if k not in _DROPPED_CONFIG_KEYS}
    (directory / "hf_config.json").write_text(json.dumps(kwargs))
    state = {k: np.ascontiguousarray(np.asarray(v, np.float32))
             for k, v in to_hf_state_dict(params, config, fused_experts=True, include_mtp=False).items()}
    save_file(state, str(directory / "model.safetensors"))
    return directory


def load_model(directory: str | Path, attention: str, threads: int):
    """GlmMoeDsaForCausalLM in fp32 with the exported weights (strict load)."""
    if attention not in HF_ATTENTION:
        raise ValueError(f"attention={attention!r} is invalid: must be one of {HF_ATTENTION}")
    import torch
    from safetensors.torch import load_file
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.set_num_threads(threads)
    directory = Path(directory)
    hf_config = GlmMoeDsaConfig(**json.loads((directory / "hf_config.json").read_text()))
    hf_config._attn_implementation = attention
    model = GlmMoeDsaForCausalLM(hf_config)
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model


def adamw_train_runner(model, optim: dict):
    """One HF training step per call: forward with labels, backward, clip, torch AdamW with glm5_jax's
    groups (no decay on 1-D leaves), as `train_step_vs_hf.hf_train_runner`. Returns the loss."""
    import torch

    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": optim["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=optim["lr"], betas=(optim["b1"], optim["b2"]), eps=optim["eps"])

    def run(tokens: np.ndarray) -> float:
        ids = torch.from_numpy(tokens).long()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim["grad_clip_norm"])
        optimizer.step()
        return float(loss.detach())

    return run
