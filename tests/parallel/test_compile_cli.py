"""`glm5 compile`: the training step `glm5 train` would run, compiled for a TPU pod by libtpu on this CPU-only
machine, with the printed per-chip memory equal to XLA's own `memory_analysis()` of that step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import pytest

from glm5_jax.cli import main
from glm5_jax.config.experiment import load_experiment
from glm5_jax.parallel.aot import abstract_train_step
from glm5_jax.parallel.topology import TopologyError, get_topology

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.batch_size=8", "train.seq_len=128", "optim.name=adamw", "model.compute_dtype=bfloat16"]


@pytest.mark.slow
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, mesh", [("v5p-8", ["mesh.fsdp=4"]), ("v6e-8", ["mesh.fsdp=4", "mesh.data=2"])])
def test_compile_prints_xla_memory_and_fits(topology, mesh, capsys, monkeypatch):
    compiles = []  # (lowered, compiled) of every compile the command runs: the step is compiled once, by it
    compile_lowered = jax.stages.Lowered.compile

    def recording_compile(lowered, *args, **kwargs):
        compiles.append((lowered, compile_lowered(lowered, *args, **kwargs)))
        return compiles[-1][1]

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording_compile)
    config = str(REPO / "configs" / "tiny.yaml")
    code = main(["compile", config, "--topology", topology, *mesh, *SMALL, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["fits"] and "fits" in out
    assert report["chips"] == get_topology(topology).num_chips

    # What it compiled is the step `abstract_train_step` builds from the same config (compared as lowered
    # programs, so the step is not compiled a second time), and it printed XLA's memory analysis of it.
    assert len(compiles) == 1, len(compiles)
    lowered, compiled = compiles[0]
    cfg = load_experiment(config, [*mesh, *SMALL])
    jitted, state, batch, _ = abstract_train_step(cfg, get_topology(topology).devices())
    assert jitted.trace(state, batch).lower().as_text() == lowered.as_text()
    memory = compiled.memory_analysis()
    printed = {name: int(re.search(rf"^  {name}\s+([\d,]+) bytes", out, re.M).group(1).replace(",", ""))
               for name in ("arguments", "outputs", "temporaries", "aliased")}
    assert printed == {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                       "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes}
    assert report["matmul_flops"] > 0 and report["collective_bytes"], report
    assert report["roofline"]["bound"] in ("compute", "collectives")


def test_unknown_topology_is_refused_by_name(capsys):
    assert main(["compile", str(REPO / "configs" / "tiny.yaml"), "--topology", "v9x-12"]) == 2
    err = capsys.readouterr().err
    assert "v9x-12" in err and "v5p-128" in err
    with pytest.raises(TopologyError, match="generation"):
        get_topology("v9:2x2")


def test_rl_mode_is_refused_before_compiling():
    cfg = load_experiment(str(REPO / "configs" / "tiny.yaml"), ["train.mode=rl", "rl.loss=grpo"])
    with pytest.raises(ValueError, match="train.mode='rl'"):
        abstract_train_step(cfg, jax.devices())
