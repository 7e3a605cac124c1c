"""Where Hugging Face tensors come from: a checkpoint directory (read one tensor at a time, FP8 dequantized
on the way in) or an in-memory state dict. Both answer `names`, `shape`, `dtype` without reading data, so
a whole import is checked against the config before the first byte of weights is read."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from glm5_jax.convert.fp8 import FP8_DTYPES, SCALE_SUFFIX, BlockFp8Format, Fp8FormatError
from glm5_jax.convert.safetensors_io import TensorRecord, read_header, read_tensor

INDEX_FILE = "model.safetensors.index.json"


class CheckpointFormatError(ValueError):
    """A checkpoint directory's files, index or config are missing or inconsistent."""


class DictSource:
    """Tensors of an in-memory state dict (numpy arrays or torch tensors)."""

    def __init__(self, state_dict: dict):
        self._state = dict(state_dict)

    def names(self) -> set[str]:
        return set(self._state)

    def has(self, name: str) -> bool:
        return name in self._state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def stored_dtype(self, name: str) -> np.dtype:
        value = self._state[name]
        return np.dtype(np.float32) if hasattr(value, "detach") else np.asarray(value).dtype

    def read(self, name: str) -> np.ndarray:
        value = self._state[name]
        if hasattr(value, "detach"):  # torch: numpy has bfloat16 only through ml_dtypes, so go via float32
            value = value.detach().cpu().float().numpy()
        return np.asarray(value)


class CheckpointDir:
    """A safetensors checkpoint directory: `config.json`, and either `model.safetensors.index.json` with the
    files it names or every `*.safetensors` file. FP8 weights with `<name>_scale_inv` partners are
    dequantized to `fp8_dtype` when read, and their names collected in `dequantized`."""

    def __init__(self, path: str | Path, *, fp8_dtype="bfloat16"):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointFormatError(f"checkpoint path {str(self.path)!r} is not a directory")
        self.config = self._read_config()
        self.fp8 = BlockFp8Format.from_quantization_config(self.config.get("quantization_config"))
        self.fp8_dtype = np.dtype(ml_dtypes.bfloat16 if fp8_dtype == "bfloat16" else fp8_dtype)
        self._records = self._read_records()
        self.dequantized: list[str] = []
        self._check_fp8_pairs()

    def _read_config(self) -> dict:
        file = self.path / "config.json"
        if not file.is_file():
            raise CheckpointFormatError(f"{str(file)!r} not found: a Hugging Face checkpoint directory holds "
                                        "config.json next to its safetensors files")
        try:
            return json.loads(file.read_text())
        except ValueError as err:
            raise CheckpointFormatError(f"{str(file)!r} is not valid JSON: {err}") from err

    def _read_records(self) -> dict[str, TensorRecord]:
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointFormatError(f"{str(index_file)!r} has no 'weight_map' of tensor name -> file")
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointFormatError(f"no *.safetensors files and no {INDEX_FILE} in {str(self.path)!r}")
        records: dict[str, TensorRecord] = {}
        for file_name in files:
            file = self.path / file_name
            if not file.is_file():
                raise CheckpointFormatError(f"{INDEX_FILE} names {file_name!r}, which is not in {str(self.path)!r}")
            for name, record in read_header(file)[0].items():
                if name in records:
                    raise CheckpointFormatError(f"tensor {name!r} is in both {records[name].file.name!r} and "
                                                f"{file_name!r}")
                if weight_map is None or weight_map.get(name) == file_name:
                    records[name] = record
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(records))
            if missing:
                raise CheckpointFormatError(f"{INDEX_FILE} maps {missing[0]!r} to {weight_map[missing[0]]!r}, "
                                            f"but that file has no such tensor ({len(missing)} such names)")
        return records

    def _check_fp8_pairs(self) -> None:
        for name, record in self._records.items():
            if record.dtype in FP8_DTYPES:
                if self.fp8 is None:
                    raise Fp8FormatError(f"tensor {name!r} is {record.dtype.name} but config.json has no "
                                         "quantization_config naming its block-scaled FP8 format")
                if name + SCALE_SUFFIX not in self._records:
                    raise Fp8FormatError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r} scale tensor")

    def names(self) -> set[str]:
        return {n for n in self._records if not self._is_scale(n)}

    def has(self, name: str) -> bool:
        return name in self._records and not self._is_scale(name)

    def _is_scale(self, name: str) -> bool:
        base = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
        return base is not None and base in self._records and self._records[base].dtype in FP8_DTYPES

    def shape(self, name: str) -> tuple[int, ...]:
        return self._records[name].shape

    def stored_dtype(self, name: str) -> np.dtype:
        """The dtype a tensor is read as (FP8 weights: their dequantization dtype)."""
        dtype = self._records[name].dtype
        return self.fp8_dtype if dtype in FP8_DTYPES else dtype

    def nbytes(self, name: str) -> int:
        return self._records[name].nbytes

    def read(self, name: str) -> np.ndarray:
        record = self._records[name]
        tensor = read_tensor(record)
        if record.dtype in FP8_DTYPES:
            scale = read_tensor(self._records[name + SCALE_SUFFIX])
            tensor = self.fp8.dequantize(name, tensor, scale, self.fp8_dtype)
            if name not in self.dequantized:
                self.dequantized.append(name)
        return tensor
