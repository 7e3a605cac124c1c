"""The streamed import onto an 8-device mesh (fsdp=2 expert=2 tensor=2) matches HF's logits, and the sharded
export from that mesh holds the original checkpoint's tensors bit for bit and reloads in transformers."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from xla_env import subprocess_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_streaming_import import assert_same_tensors  # noqa: E402

CHECKS = Path(__file__).with_name("_import_multidevice_checks.py")
EXPECTED = ["imported onto fsdp=2 expert=2 tensor=2 with the rule-table shardings",
            "sharded import matches HF logits", "each HF tensor read once per process", "exported from the mesh into"]


@pytest.mark.slow
def test_import_and_export_on_8_devices(hf_checkpoint, tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    path, model, tokens, logits = hf_checkpoint
    np.savez(tmp_path / "expected.npz", tokens=tokens, logits=logits)
    result = subprocess.run([sys.executable, str(CHECKS), str(path), str(tmp_path / "expected.npz"),
                             str(tmp_path / "export")], capture_output=True, text=True, env=subprocess_env(),
                            cwd=CHECKS.parents[2], timeout=300)
    print(result.stdout)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    passed = [line[len("PASS "):] for line in result.stdout.splitlines() if line.startswith("PASS ")]
    for name in EXPECTED:
        assert any(line.startswith(name) for line in passed), f"no PASS for {name!r}:\n{result.stdout}"
    assert_same_tensors(path, tmp_path / "export")
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    original = GlmMoeDsaForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(back[k], v) for k, v in original.items()) and sorted(back) == sorted(original)
