"""One tiny stdlib run shared by the command-line tests (trained once per session through `glm5 train`, in the
test process so that the programs it compiles stay in the session's compilation cache)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_in_process import run_cli  # noqa: E402
from xla_env import REPO  # noqa: E402

# The README model, a few steps on a few files: every feature on (DSA top-k 8 < the sequences, MoE, MTP).
TRAIN_OVERRIDES = ("train.steps=4", "train.batch_size=2", "train.seq_len=64", "train.log_every=2",
                   "train.eval_batches=2", "data.max_files=8", "checkpoint.every=2", "model.index_topk=8",
                   "optim.warmup_steps=1", "optim.total_steps=4")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """(run directory, the run's summary line as a dict)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    done = run_cli("train", str(REPO / "configs" / "train_tiny_stdlib.yaml"), *TRAIN_OVERRIDES,
                   f"train.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.split("summary: ", 1)[1].splitlines()[0])
    return run_dir, summary
