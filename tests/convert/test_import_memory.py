"""`glm5 import-hf` of a ~330 MB bf16 checkpoint on one process peaks at no more than the process's own shards
(the whole checkpoint, on one device) plus twice the largest tensor above its starting RSS: a tensor is read,
transposed and placed, never the whole checkpoint held twice or upcast."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from xla_env import subprocess_env

CHECK = Path(__file__).with_name("_import_memory_check.py")


def _run(*args: str) -> str:
    result = subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, env=subprocess_env(),
                            cwd=CHECK.parents[2], timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.slow
def test_import_peak_memory_is_bounded(tmp_path):
    _run("write", str(tmp_path / "hf"))
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 4
    out = _run("import", str(tmp_path / "hf"), str(tmp_path / "run"))
    figures = json.loads(out.strip().splitlines()[-1])
    used = figures["peak_rss_bytes"] - figures["rss_before_bytes"]
    used_placing = figures["placed_peak_rss_bytes"] - figures["rss_before_bytes"]
    bound = figures["checkpoint_bytes"] + 2 * figures["largest_tensor_bytes"]
    mib = {k: round(v / 2**20, 1) for k, v in figures.items()}
    print(f"import memory: {mib}, used {used / 2**20:.1f} MiB ({used_placing / 2**20:.1f} MiB before saving), "
          f"bound {bound / 2**20:.1f} MiB")
    assert figures["checkpoint_bytes"] > 300 * 10**6
    assert used_placing <= bound, ("reading and placing the tensors", used_placing, bound, mib)
    assert used <= bound, ("reading, placing and saving", used, bound, mib)
