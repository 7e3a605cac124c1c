"""Context parallelism (`mesh.context`) on 8 fake CPU devices: the load-balanced order of the split (layout, its
inverse and gradient, equal causal work per chip), every training objective's loss and gradients, and the
indexer's top-k, on sequences split over `context` (alone, with `fsdp`, with `expert`; the jnp paths
and the Pallas kernels) equal one device's. One subprocess runs tests/parallel/_context_checks.py (the device-count flag must be set before jax
is imported; the rest of the suite keeps one device)."""

from pathlib import Path

import pytest
from xla_env import run_pass_checks

CHECKS = Path(__file__).with_name("_context_checks.py")
# The checks that must report PASS (the child's MESHES and TOPK_MESHES: its module sets the device-count flag
# on import, so it is not imported here).
EXPECTED = [
    *(f"balanced order on {sizes}" for sizes in ("{'context': 2, 'fsdp': 4}", "{'context': 4, 'fsdp': 2}",
                                                  "{'context': 8}")),
    "top-k selections on {'context': 8}",
    "top-k over key blocks on {'context': 8}",
    *(f"{batch} (sparse) on {sizes}" for sizes in ("{'context': 8}", "{'context': 2, 'fsdp': 2}",
                                                   "{'context': 2, 'expert': 2}") for batch in ("pretrain", "sft")),
    "dsa_sparse (sparse) on {'context': 4}",
    "dsa_warmup (sparse) on {'context': 2}",
    "rl (dense) on {'context': 4}",
]
# The child's PALLAS_MESHES: the kernels (interpret mode) across the split.
EXPECTED_KERNELS = ["dsa_sparse (pallas) on {'context': 2}", "dsa_warmup (pallas) on {'context': 2, 'fsdp': 2}"]


@pytest.mark.slow
def test_context_parallel_equals_one_device():
    run_pass_checks(CHECKS, expected=EXPECTED)


@pytest.mark.slow
def test_pallas_kernels_across_the_split_equal_one_device():
    run_pass_checks(CHECKS, "pallas", expected=EXPECTED_KERNELS)


@pytest.mark.slow
def test_context_split_shrinks_per_device_flops_and_memory():
    """tiny.yaml's training step at 16K tokens compiled for context 4 and for one device (never run)."""
    run_pass_checks(CHECKS, "scaling", expected=["context=4 at 16384 tokens"])
