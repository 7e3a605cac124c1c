"""The dependency-free safetensors reader/writer agrees with the safetensors library and refuses bad files."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

from glm5_jax.convert.safetensors_io import (SafetensorsError, TensorSpec, read_header, read_tensor,
                                             write_safetensors)


def test_round_trip_with_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file, save_file

    arrays = {"bf16": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16),
              "f32": np.linspace(-1, 1, 5, dtype=np.float32), "i64": np.arange(3, dtype=np.int64),
              "fp8": np.array([[0.5, -448.0]], np.float32).astype(ml_dtypes.float8_e4m3fn)}
    specs = [TensorSpec(name, a.dtype, a.shape) for name, a in arrays.items()]
    write_safetensors(tmp_path / "ours.safetensors", specs, iter(arrays.values()))
    theirs = load_file(str(tmp_path / "ours.safetensors"))
    assert theirs["bf16"].dtype == torch.bfloat16 and theirs["fp8"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(theirs["bf16"].float().numpy(), arrays["bf16"].astype(np.float32))
    np.testing.assert_array_equal(theirs["fp8"].float().numpy(), [[0.5, -448.0]])
    save_file(theirs, str(tmp_path / "theirs.safetensors"))
    records, _ = read_header(tmp_path / "theirs.safetensors")
    for name, array in arrays.items():
        got = read_tensor(records[name])
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got.view(np.uint8), array.view(np.uint8))


def test_writer_checks_arrays_against_specs(tmp_path):
    spec = TensorSpec("w", np.dtype(np.float32), (2,))
    with pytest.raises(SafetensorsError, match=r"tensor 'w': got float64\[2\], the header says float32\[2\]"):
        write_safetensors(tmp_path / "a.safetensors", [spec], iter([np.zeros(2)]))
    with pytest.raises(SafetensorsError, match="2 arrays for 1 tensor specs|more arrays than the 1"):
        write_safetensors(tmp_path / "a.safetensors", [spec], iter([np.zeros(2, np.float32)] * 2))
    with pytest.raises(SafetensorsError, match="0 arrays for 1 tensor specs"):
        write_safetensors(tmp_path / "a.safetensors", [spec], iter([]))


def test_malformed_files_are_refused(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(SafetensorsError, match="shorter than the 8-byte header length"):
        read_header(short)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(SafetensorsError, match=r"tensor 'w' data_offsets \[0, 16\] do not match"):
        read_header(truncated)
    header = json.dumps({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(SafetensorsError, match="tensor 'w' has dtype 'C64'"):
        read_header(odd)
