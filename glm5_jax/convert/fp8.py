"""Block-scaled FP8 checkpoints (transformers' fine-grained FP8, as in the DeepSeek-V3 / GLM-5 FP8 releases).

config.json carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], "activation_scheme": "dynamic", "modules_to_not_convert": [...]}`. Each quantized linear stores
`<module>.weight` as float8_e4m3fn [out, in] and `<module>.weight_scale_inv` as float32
[ceil(out / bo), ceil(in / bi)]; the real weight is `weight[i, j] * weight_scale_inv[i // bo, j // bi]`.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)


class Fp8FormatError(ValueError):
    """An FP8 checkpoint's quantization_config or scale tensors are not the block-scaled format."""


@dataclasses.dataclass(frozen=True)
class BlockFp8Format:
    block_out: int
    block_in: int

    @classmethod
    def from_quantization_config(cls, quantization_config: dict | None) -> "BlockFp8Format | None":
        """The format named by config.json's `quantization_config` (None when the checkpoint is not FP8)."""
        if not quantization_config:
            return None
        where = "config.json quantization_config"
        method = quantization_config.get("quant_method")
        if method != "fp8":
            raise Fp8FormatError(f"{where}.quant_method={method!r} is not supported: only 'fp8' "
                                 "(fine-grained block-scaled FP8) checkpoints can be read")
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8FormatError(f"{where}.fmt={fmt!r} is not supported: only 'e4m3' (float8_e4m3fn)")
        block = quantization_config.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise Fp8FormatError(f"{where}.weight_block_size={block!r} is invalid: must be two positive "
                                 "integers [out, in], e.g. [128, 128] (per-tensor scales are not supported)")
        return cls(block_out=block[0], block_in=block[1])

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        out, inp = weight_shape
        return (-(-out // self.block_out), -(-inp // self.block_in))

    def dequantize(self, name: str, weight: np.ndarray, scale_inv: np.ndarray, dtype) -> np.ndarray:
        """`weight * scale_inv` broadcast over the blocks, computed in float32 and returned as `dtype`."""
        if weight.ndim != 2:
            raise Fp8FormatError(f"tensor {name!r}: FP8 weight of shape {weight.shape}, block scaling needs 2-D")
        expected = self.scale_shape(weight.shape)
        if tuple(scale_inv.shape) != expected:
            raise Fp8FormatError(f"tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale_inv.shape)}; weight "
                                 f"{weight.shape} in [{self.block_out}, {self.block_in}] blocks needs {expected}")
        out, inp = weight.shape
        result = np.empty((out, inp), dtype)
        # One row block at a time, so the float32 temporaries are a block's rows, not the whole tensor.
        for block, start in enumerate(range(0, out, self.block_out)):
            rows = slice(start, start + self.block_out)
            row_scale = np.repeat(scale_inv[block].astype(np.float32), self.block_in)[:inp]
            result[rows] = (weight[rows].astype(np.float32) * row_scale).astype(dtype)
        return result
