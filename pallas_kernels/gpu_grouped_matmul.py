"""The grouped matmul on GPU (placeholder while the Triton kernels are written)."""

from __future__ import annotations


def gpu_grouped_matmul(lhs, rhs, group_sizes, group_offset, *, tiling=None, interpret=False):
    raise NotImplementedError("grouped_matmul has no GPU kernel yet")
