"""A multi-file bf16 checkpoint written by transformers' own save_pretrained(max_shard_size=...): streamed onto
one device it matches HF's logits; exported back sharded, transformers reloads it bit-exactly; saved as an
orbax import it is what `train.init_from` starts from."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_checkpoints import SMALL  # noqa: E402

from glm5_jax.convert.hf import ConversionError, load_hf_checkpoint  # noqa: E402
from glm5_jax.convert.sharded_export import export_hf  # noqa: E402
from glm5_jax.convert.streaming_import import import_hf, save_imported  # noqa: E402
from glm5_jax.convert.tensor_source import INDEX_FILE, CheckpointFormatError  # noqa: E402
from glm5_jax.model.transformer import FORWARD_STATIC_ARGNAMES, forward  # noqa: E402
from glm5_jax.parallel.sharding import abstract_params  # noqa: E402


def test_checkpoint_is_multi_file_bf16(hf_checkpoint):
    path, *_ = hf_checkpoint
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 3
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in weight_map  # released per-expert layout
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_import_on_one_device_matches_hf_logits(hf_checkpoint):
    path, _, tokens, hf_logits = hf_checkpoint
    imported = import_hf(path, compute_dtype="float32")
    assert imported.config.param_dtype == "bfloat16" and imported.config.compute_dtype == "float32"
    assert "compute float32 (asked)" in imported.dtype_note and "config.json dtype=bfloat16" in imported.dtype_note
    assert imported.dequantized == []
    leaves = jax.tree.leaves(imported.params)
    assert all(leaf.dtype == jax.numpy.bfloat16 for leaf in leaves)  # bf16 stays bf16
    assert {leaf.sharding.device_set.pop() for leaf in leaves} == {jax.devices()[0]}
    jitted = jax.jit(forward, static_argnames=FORWARD_STATIC_ARGNAMES)
    logits = np.asarray(jitted(imported.params, tokens, config=imported.config).logits)
    np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=0)


def test_streamed_and_in_memory_imports_agree(hf_checkpoint):
    path, model, *_ = hf_checkpoint
    streamed = import_hf(path).params
    host, _ = load_hf_checkpoint(path)
    for (key, a), b in zip(jax.tree_util.tree_flatten_with_path(streamed)[0], jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(key))
    # Experts stacked in order: expert 5 of the first MoE layer is HF's tensor, transposed.
    want = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][5, :SMALL.moe_intermediate_size]
    np.testing.assert_array_equal(np.asarray(streamed["moe_layers"]["moe"]["experts"]["gate_proj"][0, 5]).T,
                                  want.float().numpy().astype(ml_dtypes.bfloat16))


def test_export_sharded_reloads_in_transformers_bit_exactly(hf_checkpoint, tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    path, model, *_ = hf_checkpoint
    imported = import_hf(path)
    files = export_hf(imported.params, imported.config, tmp_path, max_shard_bytes=100_000)
    assert len(files) >= 4 and all(f.stat().st_size <= 100_000 + 10_000 for f in files)  # + header
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(json.loads((path / INDEX_FILE).read_text())["weight_map"])
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    # Every stored tensor is the original's, dtype and bits (read by safetensors itself).
    assert_same_tensors(path, tmp_path)
    # transformers loads both alike (it upcasts the router to float32 either way).
    original = GlmMoeDsaForCausalLM.from_pretrained(path).state_dict()
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert sorted(original) == sorted(back)
    assert back["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def assert_same_tensors(dir_a: Path, dir_b: Path) -> None:
    from safetensors import safe_open

    def tensors(path):
        out = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    a, b = tensors(dir_a), tensors(dir_b)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_orbax_import_is_what_train_init_from_loads(hf_checkpoint, tmp_path):
    from glm5_jax.config import load_model_config
    from glm5_jax.runner import load_params

    path, *_ = hf_checkpoint
    imported = import_hf(path)
    save_imported(imported, tmp_path / "run", source=str(path))
    config = load_model_config(tmp_path / "run" / "model.yaml")
    assert config == imported.config
    # A training config keeps float32 master weights: the bf16 import is restored into them exactly.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        abstract_params(dataclasses.replace(config, param_dtype="float32")))
    restored = load_params(tmp_path / "run", like)
    for (key, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(imported.params)):
        assert a.dtype == np.float32, jax.tree_util.keystr(key)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32))
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        save_imported(imported, tmp_path / "run")


def test_bad_checkpoint_directories_are_refused(hf_checkpoint, tmp_path):
    path, *_ = hf_checkpoint
    with pytest.raises(CheckpointFormatError, match="is not a directory"):
        import_hf(tmp_path / "absent")
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in path.iterdir():
        (broken / item.name).symlink_to(item)
    first = sorted(p.name for p in path.glob("model-*.safetensors"))[0]
    (broken / first).unlink()
    with pytest.raises(CheckpointFormatError, match=f"names {first!r}, which is not in"):
        import_hf(broken)
    other = dataclasses.replace(SMALL, num_hidden_layers=2)
    with pytest.raises(ConversionError, match="tensors the config does not use.*model.layers.2"):
        import_hf(path, config=other)
