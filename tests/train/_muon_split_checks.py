"""Run as a subprocess on 8 fake CPU devices (tests/train/test_muon_layerwise.py): Muon's Newton-Schulz on
layers spread over the mesh equals the one-device update, and its compiled step all-reduces nothing, where
Newton-Schulz on FSDP shards all-reduces a Gram matrix per product."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
import _eight_devices  # noqa: E402,F401  (8 fake devices, before jax)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402

from glm5_jax.parallel.hlo_stats import hlo_stats  # noqa: E402
from glm5_jax.train.muon_layerwise import scale_by_muon_layerwise  # noqa: E402

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "expert"))
FSDP = ("fsdp", "expert")
# Twelve layers of an FSDP-sharded [in, out] matrix (padded to 16: two per device; whole matrices do fewer
# Newton-Schulz FLOPs per chip than shards here) and three layers of 8 experts, each whole on its device pair.
# A second stacked matrix, sharded on its output side, is spread after the first (one leaf at a time). A third,
# split over `fsdp` only (replicated over `expert`, as weights are over `data`), is spread over its 4 devices.
SHARDINGS = {"dense": NamedSharding(MESH, P(None, FSDP, None)), "experts": NamedSharding(MESH, P(None, FSDP)),
             "attn": NamedSharding(MESH, P(None, None, FSDP)), "half": NamedSharding(MESH, P(None, "fsdp", None))}
DIMS = {"dense": MuonDimensionNumbers(reduction_axis=1, output_axis=2),
        "experts": MuonDimensionNumbers(reduction_axis=2, output_axis=3),
        "attn": MuonDimensionNumbers(reduction_axis=1, output_axis=2),
        "half": MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
STACKED = {"dense": True, "experts": True, "attn": True, "half": True}
HOMES = {"dense": SHARDINGS["dense"], "experts": False, "attn": SHARDINGS["attn"],  # experts stay put
         "half": SHARDINGS["half"]}


def tree(key):
    a, b, c, d = jax.random.split(key, 4)
    return {"dense": jax.random.normal(a, (12, 64, 32)), "experts": jax.random.normal(b, (3, 8, 16, 8)),
            "attn": jax.random.normal(c, (12, 24, 64)), "half": jax.random.normal(d, (6, 32, 16))}


def muon(homes):
    return scale_by_muon_layerwise(lambda t: DIMS, lambda t: STACKED, ns_steps=5, beta=0.95, eps=1e-8,
                                   home_fn=None if homes is None else lambda t: homes)


def main():
    params = jax.device_put(tree(jax.random.key(0)), SHARDINGS)
    one, spread = muon(None), muon(HOMES)
    state_one = state_spread = jax.device_put(one.init(params), None)
    texts = {}
    for step in range(2):
        grads = jax.device_put(tree(jax.random.key(step + 1)), SHARDINGS)
        out_one, state_one = jax.jit(one.update)(grads, state_one)
        update = jax.jit(spread.update)
        out_spread, state_spread = update(grads, state_spread)
        for name in ("dense", "attn", "half"):  # back home
            assert out_spread[name].sharding.is_equivalent_to(SHARDINGS[name], 3), name
        for a, b in zip(jax.tree.leaves((out_one, state_one)), jax.tree.leaves((out_spread, state_spread))):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
        texts = {"shards": jax.jit(one.update).lower(grads, state_one).compile().as_text(),
                 "spread": update.lower(grads, state_spread).compile().as_text()}
    moved = {name: hlo_stats(text, 8).collective_bytes for name, text in texts.items()}
    reduced = {name: collectives.get("all-reduce", 0) for name, collectives in moved.items()}
    assert reduced["shards"] > 0, reduced  # Gram matrices of FSDP shards
    assert reduced["spread"] == 0, reduced
    # Only all-to-alls move the layers: spread over the replicated axis too, the padded stack was all-gathered.
    assert set(moved["spread"]) == {"all-to-all"}, moved["spread"]
    print(f"PASS spread Newton-Schulz equals one device over 2 steps; all-reduce bytes {reduced['shards']:.0f} on "
          f"shards, 0 spread, which moves layers by all-to-all only")


if __name__ == "__main__":
    main()
