"""The streamed import onto an 8-device mesh (fsdp=2 expert=2 tensor=2) matches HF's logits, and the sharded
export from that mesh holds the original checkpoint's tensors bit for bit and reloads in transformers."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from xla_env import run_pass_checks

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
    print(run_pass_checks(CHECKS, str(path), str(tmp_path / "expected.npz"), str(tmp_path / "export"),
                          expected=EXPECTED, timeout=300))
    assert_same_tensors(path, tmp_path / "export")
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    original = GlmMoeDsaForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(back[k], v) for k, v in original.items()) and sorted(back) == sorted(original)
