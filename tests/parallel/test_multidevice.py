"""Expert parallelism, sharded creation and checkpoints, the planner against XLA, and a sharded training step,
on 8 fake CPU devices. Each group runs tests/parallel/_multidevice_checks.py in a subprocess, because the
device-count flag must be set before jax is imported and the rest of the suite keeps one device."""

from pathlib import Path

import pytest
from xla_env import run_pass_checks

CHECKS = Path(__file__).with_name("_multidevice_checks.py")

# groups run in one subprocess (they share compiled functions, or are small enough that a second python +
# jax start would be a large part of their time) -> the checks they must report as passed
EXPECTED = {
    "plan ep": [  # plan first: ep swaps in an emulated ragged_all_to_all for the rest of the process
        "ep {'expert': 8} capacity_factor=0.0 transport=padded (dropped 0)",
        "ep {'expert': 8} capacity_factor=0.6 transport=padded",
        "ep {'data': 2, 'expert': 4} capacity_factor=0.0 transport=padded (dropped 0)",
        "ep {'data': 2, 'expert': 4} capacity_factor=0.6 transport=padded",
        "ep {'data': 2, 'expert': 2, 'tensor': 2} capacity_factor=0.0 transport=padded (dropped 0)",
        "ep {'data': 2, 'expert': 2, 'tensor': 2} capacity_factor=0.6 transport=padded",
        "ep {'expert': 8} capacity_factor=0.0 transport=padded row_block=4 (dropped 0)",
        "ep {'data': 2, 'expert': 4} capacity_factor=0.6 transport=padded row_block=4",
        "dropped tokens get only the shared expert on {'data': 2, 'expert': 4}",
        "ep {'expert': 8} capacity_factor=0.6 transport=ragged",
        "ep {'data': 2, 'expert': 2, 'tensor': 2} capacity_factor=0.0 transport=ragged (dropped 0)",
        "ep {'expert': 8} capacity_factor=0.6 transport=ragged row_block=16",
        "planner within 15% of XLA: one device, no remat, ragged MoE, MTP",
        "planner within 15% of XLA: data=2 fsdp=2 expert=2, full remat, ep MoE, MTP",
    ],
    "checkpoint train_step": [
        "params are created sharded by the rule table, with the values of init",
        "optimizer state is created sharded like its parameters",
        "checkpoint saved on a 2x4 mesh restores on 8x1 with identical values",
        "checkpoint saved on a 2x4 mesh restores on one device with identical values",
        "one training step on a 2x2x2 mesh equals the single-device step",
        "three pinned-sharding steps compile one executable",
        "wide expert parallelism (expert=8): one training step equals the single-device step",
    ],
    "scaling": [
        "data=8: per-device FLOPs",
        "fsdp=8: per-device FLOPs",
        "fsdp=2 x expert=4: per-device FLOPs",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(EXPECTED))
def test_multidevice(group):
    run_pass_checks(CHECKS, *group.split(), expected=EXPECTED[group])
