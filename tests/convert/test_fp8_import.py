"""Block-scaled FP8 checkpoints (transformers' fine-grained FP8 layout, written here with torch's
float8_e4m3fn and safetensors): imported, they equal the dequantization computed independently in numpy."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_checkpoints import SMALL, write_fp8_checkpoint  # noqa: E402

from glm5_jax.convert.fp8 import Fp8FormatError  # noqa: E402
from glm5_jax.convert.hf import hf_config_dict, to_hf_state_dict  # noqa: E402
from glm5_jax.convert.streaming_import import import_hf  # noqa: E402
from glm5_jax.parallel.sharding import abstract_params  # noqa: E402

CONFIG = dataclasses.replace(SMALL, num_nextn_predict_layers=1, mtp_num_steps=1).validate()  # MTP quantized too


@pytest.fixture(scope="module")
def float_state():
    rng = np.random.RandomState(3)
    params = jax.tree.map(lambda a: (0.05 * rng.randn(*a.shape)).astype(np.float32), abstract_params(CONFIG))
    return to_hf_state_dict(params, CONFIG)


def reference_dequantized(path: Path, dtype) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, FP8 ones multiplied by their block scales, straight from the files."""
    from safetensors import safe_open

    raw = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            raw.update({k: f.get_tensor(k).float().numpy() for k in f.keys()})
    block = json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"]
    out = {}
    for name, value in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in raw:
            scale = np.kron(raw[name + "_scale_inv"], np.ones(block, np.float32))[:value.shape[0], :value.shape[1]]
            value = value * scale
        out[name] = value.astype(dtype)
    return out


@pytest.mark.parametrize("block", [(16, 16), (128, 128)])
@pytest.mark.parametrize("fp8_dtype", ["bfloat16", "float32"])
def test_fp8_import_equals_numpy_dequantization(float_state, tmp_path, block, fp8_dtype):
    quantized = write_fp8_checkpoint(tmp_path, float_state, hf_config_dict(CONFIG), block)
    assert "model.layers.3.mlp.experts.5.up_proj.weight" in quantized  # MTP layer's experts too
    imported = import_hf(tmp_path, fp8_dtype=fp8_dtype)
    assert sorted(imported.dequantized) == sorted(quantized)
    assert "mtp" in imported.params
    dtype = np.float32 if fp8_dtype == "float32" else ml_dtypes.bfloat16
    want = reference_dequantized(tmp_path, dtype)
    got = to_hf_state_dict(jax.tree.map(np.asarray, imported.params), CONFIG)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == (dtype if name in quantized else ml_dtypes.bfloat16), name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # And it is the original weight up to e4m3's 3 mantissa bits (relative step 1/16 of each block's max).
    for name in quantized:
        error = np.abs(got[name].astype(np.float32) - float_state[name])
        assert error.max() <= np.abs(float_state[name]).max() / 16 + 1e-6, name


def test_fp8_format_errors_name_the_problem(float_state, tmp_path):
    write_fp8_checkpoint(tmp_path, float_state, hf_config_dict(CONFIG), (16, 16))
    config_file = tmp_path / "config.json"
    good = json.loads(config_file.read_text())

    def with_quantization(**changes):
        config_file.write_text(json.dumps(dict(good, quantization_config={**good["quantization_config"], **changes})))

    with_quantization(quant_method="bitsandbytes")
    with pytest.raises(Fp8FormatError, match="quant_method='bitsandbytes' is not supported"):
        import_hf(tmp_path)
    with_quantization(weight_block_size=None)
    with pytest.raises(Fp8FormatError, match="weight_block_size=None is invalid"):
        import_hf(tmp_path)
    with_quantization(weight_block_size=[32, 32])  # the stored scales are for 16 x 16 blocks
    with pytest.raises(Fp8FormatError, match=r"_scale_inv' has shape \(\d+, \d+\); weight .* in \[32, 32\] blocks"):
        import_hf(tmp_path)
    config_file.write_text(json.dumps({k: v for k, v in good.items() if k != "quantization_config"}))
    with pytest.raises(Fp8FormatError, match="float8_e4m3fn but config.json has no quantization_config"):
        import_hf(tmp_path)


def test_fp8_weight_without_its_scale_is_refused(float_state, tmp_path):
    from safetensors.torch import save_file

    name = "model.layers.0.self_attn.q_a_proj.weight"
    write_fp8_checkpoint(tmp_path, float_state, hf_config_dict(CONFIG), (16, 16))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    file = tmp_path / index["weight_map"].pop(name + "_scale_inv")
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != name + "_scale_inv"}
    save_file(kept, str(file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Fp8FormatError, match=f"FP8 tensor '{name}' has no '{name}_scale_inv'"):
        import_hf(tmp_path)
