"""`glm5 import-hf` / `glm5 export-hf` from the command line (their argv, run in this process: nothing needs
a fresh one), and their argument checks."""

import pytest

from glm5_jax.cli import main
from glm5_jax.convert.run_dir import parse_size



@pytest.mark.slow
def test_import_then_export_from_the_command_line(hf_checkpoint, tmp_path, capsys):
    path, *_ = hf_checkpoint
    code = main(["import-hf", str(path), str(tmp_path / "run"), "--compute-dtype", "float32"])
    imported, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "dtypes: parameters bfloat16, compute float32 (asked); config.json dtype=bfloat16" in imported
    assert "peak host memory" in imported
    assert (tmp_path / "run" / "model.yaml").is_file() and (tmp_path / "run" / "checkpoints" / "0").is_dir()
    code = main(["export-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--max-shard-size", "100KB"])
    exported, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    files = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(files) >= 4 and f"wrote {len(files)} safetensors files" in exported
    from test_streaming_import import assert_same_tensors

    assert_same_tensors(path, tmp_path / "out")


def test_command_errors_name_the_bad_argument(hf_checkpoint, tmp_path, capsys):
    path, *_ = hf_checkpoint
    assert main(["import-hf", str(path), str(tmp_path / "run"), "fsdp=2"]) == 2
    assert "argument 'fsdp=2' is invalid: expected mesh.<axis>=<size>" in capsys.readouterr().err
    assert main(["import-hf", str(path), str(tmp_path / "run"), "mesh.fsdp=2"]) == 2
    assert "mesh data=1 x fsdp=2 x expert=1 x context=1 x tensor=1 has 2 devices but 1 are available" in capsys.readouterr().err
    assert main(["import-hf", str(tmp_path / "absent"), str(tmp_path / "run")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "has neither model.yaml (written by import-hf) nor config.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("123", 123),
                                        ("1.5 kb", 1500)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "5 parsecs", "-1GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="--max-shard-size=.* is invalid"):
        parse_size(text)
