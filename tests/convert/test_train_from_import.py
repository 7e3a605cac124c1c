"""`glm5 train ... train.init_from=RUN` starts from the weights `glm5 import-hf` wrote: after one step at a tiny
learning rate (and no router-bias update) the run's parameters are the imported ones (bf16 on disk, fp32
master weights in training). Both commands run in this process (nothing needs a fresh one: one device, the
suite's compile cache). Slow: it compiles a real training step."""

import dataclasses
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from glm5_jax.cli import main
from glm5_jax.config import load_model_config
from glm5_jax.convert.run_dir import restore_run_params
from glm5_jax.convert.sharded_export import export_hf
from glm5_jax.distributed.mesh import MeshConfig, make_mesh
from glm5_jax.parallel.sharding import abstract_params

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "train_tiny_stdlib.yaml"


@pytest.mark.slow
def test_train_starts_from_imported_weights(tmp_path, capsys):
    config = dataclasses.replace(load_model_config(RECIPE), param_dtype="bfloat16")
    rng = np.random.default_rng(0)
    released = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape, np.float32)).astype(ml_dtypes.bfloat16),
                            abstract_params(config))
    export_hf(released, config, tmp_path / "hf", max_shard_bytes=500_000)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "base")]) == 0, capsys.readouterr().err[-3000:]
    code = main(["train", str(RECIPE), f"train.init_from={tmp_path / 'base'}", f"train.run_dir={tmp_path / 'ft'}",
                 "train.steps=1", "train.batch_size=2", "train.seq_len=64", "train.eval_batches=1",
                 "optim.lr=1e-7", "optim.min_lr=1e-8", "optim.warmup_steps=0", "checkpoint.every=1",
                 "train.bias_update_rate=0", "data.max_files=5", "data.validation_fraction=0"])
    out, err = capsys.readouterr()
    assert code == 0, out[-2000:] + err[-3000:]
    assert f"initialised parameters from {tmp_path / 'base'}" in out
    after, train_config = restore_run_params(tmp_path / "ft", make_mesh(MeshConfig()))
    assert train_config.param_dtype == "float32"
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(after)[0], jax.tree.leaves(released)):
        assert a.dtype == np.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b, np.float32), atol=1e-5, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
