"""Import onto an 8-device mesh and export from it, run by test_import_multidevice.py in a subprocess (the
fake-device flag must be set before jax is imported; the rest of the suite keeps one device).

Usage: python _import_multidevice_checks.py HF_DIR EXPECTED_NPZ OUT_DIR
EXPECTED_NPZ holds `tokens` and HF's float32-compute `logits`. Every check prints "PASS <name>".
"""

import collections
import os
import sys

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                                    "--xla_backend_optimization_level=0"])
os.environ["JAX_PLATFORMS"] = "cpu"

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from glm5_jax.convert.sharded_export import export_hf  # noqa: E402
from glm5_jax.convert.streaming_import import import_hf  # noqa: E402
from glm5_jax.convert.tensor_source import CheckpointDir  # noqa: E402
from glm5_jax.model.transformer import FORWARD_STATIC_ARGNAMES, forward  # noqa: E402
from glm5_jax.distributed.mesh import MeshConfig, make_mesh  # noqa: E402
from glm5_jax.parallel.sharding import param_shardings  # noqa: E402


def main(hf_dir: str, expected: str, out_dir: str) -> None:
    want = np.load(expected)
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    imported = import_hf(hf_dir, mesh=mesh, compute_dtype="float32")
    shardings = param_shardings(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), imported.params),
                                mesh, config=imported.config)
    split = 0
    for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(imported.params)[0],
                                      jax.tree.leaves(shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (jax.tree_util.keystr(path), leaf.sharding)
        assert leaf.dtype == jax.numpy.bfloat16, jax.tree_util.keystr(path)
        split += leaf.addressable_shards[0].data.size < leaf.size
    experts = imported.params["moe_layers"]["moe"]["experts"]["gate_proj"]
    assert experts.addressable_shards[0].data.shape[1] == experts.shape[1] // 2  # experts split over `expert`
    print(f"PASS imported onto fsdp=2 expert=2 tensor=2 with the rule-table shardings ({split} leaves split)")

    jitted = jax.jit(forward, static_argnames=FORWARD_STATIC_ARGNAMES)
    logits = np.asarray(jitted(imported.params, want["tokens"], config=imported.config).logits)
    err = float(np.abs(logits - want["logits"]).max())
    assert err <= 1e-4, err
    print(f"PASS sharded import matches HF logits (max abs err {err:.2e})")

    reads = collections.Counter()
    original_read = CheckpointDir.read

    def counting_read(self, name):
        reads[name] += 1
        return original_read(self, name)

    CheckpointDir.read = counting_read
    again = import_hf(hf_dir, mesh=mesh, compute_dtype="float32")
    assert reads and max(reads.values()) == 1, reads.most_common(3)
    reads.clear()
    one_slice_at_a_time = import_hf(hf_dir, mesh=mesh, compute_dtype="float32", host_budget_bytes=1)
    CheckpointDir.read = original_read
    for a, b, c in zip(*(jax.tree.leaves(p.params) for p in (imported, again, one_slice_at_a_time))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    print(f"PASS each HF tensor read once per process ({len(reads) and max(reads.values())} reads of the busiest "
          "when slices are built one at a time)")

    files = export_hf(imported.params, imported.config, out_dir, max_shard_bytes=100_000)
    print(f"PASS exported from the mesh into {len(files)} files")


if __name__ == "__main__":
    main(*sys.argv[1:])
