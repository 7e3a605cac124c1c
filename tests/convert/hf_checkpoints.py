"""Hugging Face checkpoint directories for the conversion tests, written by transformers / torch themselves:
a multi-file bf16 checkpoint from `save_pretrained(max_shard_size=...)`, and the fine-grained FP8 layout
(float8_e4m3fn weights, float32 `weight_scale_inv` per block, `quantization_config`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_reference import build_hf_model, has_boundary_ties, hf_index_scores  # noqa: E402

from glm5_jax.config import ModelConfig  # noqa: E402

# Small, with every feature: 1 dense + 2 MoE layers, grouped routing, IndexShare; odd dims (24, 12) so
# FP8 blocks of 16 leave partial blocks. Sequences (20) are longer than index_topk (8).
SMALL = ModelConfig(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                    num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                    topk_group=1, first_k_dense_replace=1, index_n_heads=4, index_head_dim=16, index_topk=8,
                    indexer_types=("full", "shared", "full"), num_nextn_predict_layers=0, mtp_num_steps=0,
                    compute_dtype="float32").validate()
SEQ = 20
MAX_SHARD_SIZE = "100KB"  # the bf16 SMALL model is ~0.5 MB: several files


def tie_free_bf16_model(config: ModelConfig = SMALL, seq: int = SEQ, dtype=torch.bfloat16):
    """(HF model in `dtype`, tokens [2, seq], float32 logits of its weights) for a seed with no near-tie at
    the indexer's k-th score (torch.topk and jax.lax.top_k break ties differently)."""
    for seed in range(30):
        model = build_hf_model(config, seed).to(dtype)
        reference = build_hf_model(config, seed).to(dtype).float()  # the stored weights, computed in fp32
        tokens = np.random.RandomState(seed).randint(0, config.vocab_size, (2, seq))
        if not has_boundary_ties(hf_index_scores(reference, tokens), config.index_topk):
            with torch.no_grad():
                logits = reference(torch.from_numpy(tokens)).logits.numpy()
            return model, tokens, logits
    raise AssertionError("no tie-free seed in 30 tries")


def write_sharded_checkpoint(path: Path, config: ModelConfig = SMALL, dtype=torch.bfloat16):
    """save_pretrained with a small max_shard_size; returns (model, tokens, fp32 logits)."""
    model, tokens, logits = tie_free_bf16_model(config, dtype=dtype)
    model.save_pretrained(path, max_shard_size=MAX_SHARD_SIZE)
    return model, tokens, logits


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The linears an FP8 release quantizes: every projection except the router, embedding and head."""
    return len(shape) == 2 and name.endswith(".weight") and (
        "_proj" in name or name.endswith(("wq_b.weight", "wk.weight")))


def quantize_block_fp8(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight as torch-compatible numpy float32 values, float32 scale_inv per block):
    each block scaled so its largest magnitude maps to 448, the e4m3 maximum."""
    out, inp = weight.shape
    rows, cols = -(-out // block[0]), -(-inp // block[1])
    scale_inv = np.zeros((rows, cols), np.float32)
    scaled = np.zeros_like(weight, dtype=np.float32)
    for r in range(rows):
        for c in range(cols):
            tile = weight[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]].astype(np.float32)
            scale_inv[r, c] = max(float(np.abs(tile).max()), 1e-12) / 448.0
            scaled[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]] = tile / scale_inv[r, c]
    return scaled, scale_inv


def write_fp8_checkpoint(path: Path, state: dict[str, np.ndarray], hf_config: dict,
                         block: tuple[int, int]) -> list[str]:
    """Write `state` (float32 numpy) in the fine-grained FP8 layout with torch's float8_e4m3fn and
    safetensors.torch; returns the names of the quantized weights."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors, quantized = {}, []
    for name, value in state.items():
        if is_fp8_linear(name, value.shape):
            scaled, scale_inv = quantize_block_fp8(value, block)
            tensors[name] = torch.from_numpy(scaled).to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(scale_inv)
            quantized.append(name)
        else:
            tensors[name] = torch.from_numpy(np.asarray(value, np.float32)).to(torch.bfloat16)
    names = sorted(tensors)
    half = len(names) // 2  # two files and an index, as the releases ship
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, members in files.items():
        save_file({n: tensors[n].contiguous() for n in members}, str(path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, members in files.items() for n in members}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = dict(hf_config, dtype="bfloat16", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)})
    (path / "config.json").write_text(json.dumps(config))
    return quantized
