"""The safetensors file format, read one tensor at a time and written as a stream (no dependency).

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (plus
an optional "__metadata__"), then the raw little-endian tensor bytes. Reading here parses only the header
and copies one tensor's bytes into a fresh buffer, so nothing of the file stays mapped: host memory is the
tensor in flight, not the pages of a memory-mapped file that has been touched. numpy has no bfloat16 or
float8, so those use ml_dtypes (installed with jax).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A safetensors file is malformed or does not hold what was asked."""


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives: its file, dtype, shape and absolute byte offset."""

    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(file: str | Path) -> tuple[dict[str, TensorRecord], dict[str, str]]:
    """The tensors of `file` by name (no data read) and its `__metadata__`."""
    file = Path(file)
    with open(file, "rb") as f:
        raw_length = f.read(8)
        if len(raw_length) != 8:
            raise SafetensorsError(f"{file}: shorter than the 8-byte header length, not a safetensors file")
        (length,) = struct.unpack("<Q", raw_length)
        if length > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{file}: header length {length} exceeds {_MAX_HEADER_BYTES} bytes, "
                                   "not a safetensors file")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise SafetensorsError(f"{file}: the header is not valid JSON ({err})") from err
    file_size = file.stat().st_size
    metadata = header.pop("__metadata__", None) or {}
    records = {}
    for name, entry in header.items():
        code = entry.get("dtype")
        if code not in DTYPES:
            raise SafetensorsError(f"{file}: tensor {name!r} has dtype {code!r}; readable dtypes are "
                                   f"{sorted(DTYPES)}")
        begin, end = entry["data_offsets"]
        shape = tuple(int(s) for s in entry["shape"])
        dtype = DTYPES[code]
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or 8 + length + end > file_size:
            raise SafetensorsError(f"{file}: tensor {name!r} data_offsets {[begin, end]} do not match shape "
                                   f"{shape} x {dtype.name} or run past the end of the file")
        records[name] = TensorRecord(file, name, dtype, shape, 8 + length + begin, end - begin)
    return records, metadata


def read_tensor(record: TensorRecord) -> np.ndarray:
    """One tensor, copied from disk into a new array."""
    out = np.empty(record.shape, record.dtype)
    with open(record.file, "rb") as f:
        f.seek(record.offset)
        if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != record.nbytes:
            raise SafetensorsError(f"{record.file}: tensor {record.name!r} is truncated")
    return out


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def write_safetensors(file: str | Path, specs: list[TensorSpec], arrays: Iterable[np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write `arrays` (in the order of `specs`, produced one at a time) as a safetensors file. The header is
    computed from the specs first, so no more than one tensor is held at a time."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for spec in specs:
        if np.dtype(spec.dtype) not in CODES:
            raise SafetensorsError(f"tensor {spec.name!r}: dtype {np.dtype(spec.dtype).name} cannot be written; "
                                   f"writable dtypes are {sorted(d.name for d in CODES)}")
        header[spec.name] = {"dtype": CODES[np.dtype(spec.dtype)], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for index, array in enumerate(_exactly(specs, arrays)):
            spec = specs[index]
            array = np.ascontiguousarray(array)
            if array.dtype != np.dtype(spec.dtype) or tuple(array.shape) != tuple(spec.shape):
                raise SafetensorsError(f"tensor {spec.name!r}: got {array.dtype.name}{list(array.shape)}, the "
                                       f"header says {np.dtype(spec.dtype).name}{list(spec.shape)}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))


def _exactly(specs: list, arrays: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    count = 0
    for array in arrays:
        count += 1
        if count > len(specs):
            raise SafetensorsError(f"more arrays than the {len(specs)} tensor specs")
        yield array
    if count != len(specs):
        raise SafetensorsError(f"{count} arrays for {len(specs)} tensor specs")
