"""Prefill and decode over a cache split by `context` (`mesh.context`) on 8 fake CPU devices: greedy tokens,
logits, logprobs and indexer selections equal one device's, the cache is split on its slots, a decode step
gathers no cache slots, and MTP speculative decoding gives one device's tokens. One
subprocess runs tests/parallel/_context_decode_checks.py (the device-count flag must be set before jax is
imported; the rest of the suite keeps one device)."""

from pathlib import Path

import pytest
from xla_env import run_pass_checks

CHECKS = Path(__file__).with_name("_context_decode_checks.py")
# The child's MESHES (its module sets the device-count flag on import, so it is not imported here).
MESHES = ("{'context': 2}", "{'context': 8}", "{'fsdp': 2, 'context': 4}")


@pytest.mark.slow
def test_context_split_generation_equals_one_device():
    expected = [f"{check} on {sizes}" for sizes in MESHES for check in ("greedy generation", "cache split")]
    expected += ["decode collectives on {'context': 8}", "speculative generation on {'fsdp': 2, 'context': 4}"]
    run_pass_checks(CHECKS, expected=expected)
