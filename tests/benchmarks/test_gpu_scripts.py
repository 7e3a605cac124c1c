"""Pieces of the GPU check's scripts checked on CPU before a lent GPU's scarce minutes are spent on them: the
profile summary of a traced program, and the kernel sweep's hooks into the kernels."""

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from benchmarks.profile_summary import summarize, xplane_file


def test_the_profile_summary_sums_a_traced_programs_events_by_name(tmp_path):
    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((256, 256))
    step(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            step(x).block_until_ready()
    records = summarize(tmp_path, steps=2, top=3)
    planes = [(plane.name, [(line.name, len(list(line.events))) for line in plane.lines])
              for plane in ProfileData.from_file(str(xplane_file(tmp_path))).planes]
    assert records, f"no timeline with events: {planes}"
    for record in records:
        assert record["busy_ms_per_step"] > 0 and 1 <= len(record["top"]) <= 3
        times = [entry["ms_per_step"] for entry in record["top"]]
        assert times == sorted(times, reverse=True)
        assert sum(entry["share"] for entry in record["top"]) <= 1 + 1e-3  # each share is rounded


def test_device_planes_without_events_leave_the_host_standing_in():
    """Once libtpu is loaded (the TPU compile tests), a CPU trace holds an empty "/device:CUSTOM:Megascale Trace"
    plane; a GPU's holds "/device:GPU:0" with its streams, which then stand alone."""
    from types import SimpleNamespace as Plane

    from benchmarks.profile_summary import _timelines

    event = Plane(name="fusion", duration_ns=5, stats=[])
    host = Plane(name="/host:CPU", lines=[Plane(name="python", events=[event])])
    empty = Plane(name="/device:CUSTOM:Megascale Trace", lines=[])
    gpu = Plane(name="/device:GPU:0", lines=[Plane(name="XLA Ops", events=[event])])
    assert [(plane, line.name) for plane, line in _timelines(Plane(planes=[empty, host]))] == [("/host:CPU", "python")]
    assert [plane for plane, _ in _timelines(Plane(planes=[empty, host, gpu]))] == ["/device:GPU:0"]


def test_the_profile_summary_names_a_directory_without_a_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.xplane.pb under"):
        summarize(tmp_path, steps=1)


def test_the_kernel_sweep_patches_names_the_kernels_still_have():
    """The sweep replaces module globals to try launch settings (`launch_settings`, `kernel_launch`): a rename
    in the kernels would otherwise surface only as an error line on a lent GPU. (Its candidates run in interpret
    mode in ~40 s, too long for the suite: `python benchmarks/gpu_kernel_sweep.py --seq 128 --topk 32 --heads 2`.)"""
    import importlib

    from benchmarks import gpu_kernel_sweep

    sparse_mla = importlib.import_module("pallas_kernels.sparse_mla")
    assert all(callable(getattr(sparse_mla, name)) for name in ("_forward_call", "_backward_call", "triton_params"))
    assert callable(gpu_kernel_sweep.indexer_module.triton_params)
    assert callable(gpu_kernel_sweep.target_module.triton_params)
    assert set(gpu_kernel_sweep.parse_args([]).candidates.split(",")) == set(gpu_kernel_sweep.CANDIDATES)
    with pytest.raises(SystemExit):
        gpu_kernel_sweep.parse_args(["--indexer-candidates", "scores_fast"])
