"""Peak host memory of `glm5 import-hf`, run by test_import_memory.py in fresh subprocesses.

    python _import_memory_check.py write HF_DIR     a bf16 checkpoint of ~330 MB (several files)
    python _import_memory_check.py import HF_DIR RUN_DIR
        prints one JSON line: checkpoint bytes, largest tensor bytes, RSS before the import (jax and its
        CPU backend loaded), the peak RSS (VmHWM) when the parameters are placed (before they are saved) and
        the process's peak RSS after the whole command

The import compiles nothing (a cold or shared persistent compile cache does not change these figures).
"""

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from glm5_jax.config import ModelConfig  # noqa: E402

# Embedding and head 32000 x 1024 bf16 (65.5 MB each) are the largest tensors; 16 experts x 3 MoE layers.
CONFIG = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
                     num_hidden_layers=4, num_attention_heads=8, q_lora_rank=512, kv_lora_rank=256,
                     qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
                     num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, index_n_heads=4,
                     index_head_dim=64, index_topk=64, num_nextn_predict_layers=0, mtp_num_steps=0,
                     param_dtype="bfloat16").validate()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def write(hf_dir: str) -> None:
    from glm5_jax.convert.sharded_export import export_hf
    from glm5_jax.parallel.sharding import abstract_params

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape, np.float32)).astype(ml_dtypes.bfloat16),
                          abstract_params(CONFIG))
    export_hf(params, CONFIG, hf_dir, max_shard_bytes=80 * 10**6)


def measure(hf_dir: str, run_dir: str) -> None:
    from glm5_jax import cli
    from glm5_jax.convert.tensor_source import CheckpointDir

    source = CheckpointDir(hf_dir)
    sizes = [source.nbytes(name) for name in source.names()]
    placed = {}
    save_imported = cli.save_imported

    def save_after_recording_the_peak(*args, **kwargs):  # so a failure says which phase went over
        placed["bytes"] = _status_kib("VmHWM") * 1024
        return save_imported(*args, **kwargs)

    cli.save_imported = save_after_recording_the_peak
    jax.devices()  # the backend is part of the baseline
    before = _status_kib("VmRSS")
    assert cli.main(["import-hf", hf_dir, run_dir]) == 0
    print(json.dumps({"checkpoint_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
                      "rss_before_bytes": before * 1024, "placed_peak_rss_bytes": placed["bytes"],
                      "peak_rss_bytes": _status_kib("VmHWM") * 1024}))


if __name__ == "__main__":
    {"write": write, "import": measure}[sys.argv[1]](*sys.argv[2:])
