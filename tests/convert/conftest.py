"""The multi-file bf16 HF checkpoint shared by the conversion tests (written once per session)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_checkpoints import write_sharded_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """(directory, the HF model in bf16, tokens [2, S], HF float32-compute logits)."""
    path = tmp_path_factory.mktemp("hf_bf16")
    model, tokens, logits = write_sharded_checkpoint(path)
    return path, model, tokens, logits
