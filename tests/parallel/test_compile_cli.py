"""`glm5 compile`: the training step `glm5 train` would run, compiled for a TPU pod by libtpu or a GPU cluster
by the CUDA plugin on this CPU-only machine, with the printed per-chip memory equal to XLA's own
`memory_analysis()` of that step and a roofline over compute, HBM and collectives; and a CPU-only start that
prints nothing of libtpu or the CUDA plugin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from gpu_compile import triton_kernel_names, triton_shared_memory
from xla_env import subprocess_env

from glm5_jax.cli import main
from glm5_jax.config.experiment import load_experiment
from glm5_jax.parallel.aot import CompileError, abstract_train_step, roofline
from glm5_jax.parallel.hlo_stats import INTER_NODE, INTRA_NODE, HloStats, hlo_stats
from glm5_jax.parallel.topology import CHIPS, TopologyError, get_topology
from pallas_kernels.shared_memory import shared_memory_limit

REPO = Path(__file__).resolve().parents[2]
# One dense and one MoE layer, one MTP step: every kind of layer (the v5p-8 step's compile: 72 -> 50 s of CPU).
SMALL = ["train.batch_size=8", "train.seq_len=128", "optim.name=adamw", "model.compute_dtype=bfloat16",
         "model.num_hidden_layers=2", "model.mtp_num_steps=1"]
# The DSA sparse stage with the Pallas kernels of the named platform: each compile below checks the CLI and, in
# the same program, that libtpu's Mosaic or the CUDA plugin's Triton compiler takes every kernel the model
# calls inside a whole sharded training step (the indexer's top-k, sparse MLA forward and backward, the sparse
# KL target: on TPU written by the forward itself, on GPU its own kernel; the dense warm-up's kernels are compiled
# in tests/ops and tests/pallas_kernels).
PALLAS_DSA = ["train.mode=dsa_sparse", "model.attention_backend=pallas"]
# One MoE layer and no MTP step (whose layer calls the same kernels again): every DSA kernel and the grouped
# matmuls are in it, and the kernel-checking compiles take less CPU (v6e-8's compile 29 -> 22 s of user time,
# h200-16's test 21.6 -> 17.8 s alone); the v5p-8 compile keeps a dense and an MoE layer and the MTP step.
ONE_MOE_LAYER = ["model.num_hidden_layers=1", "model.first_k_dense_replace=0", "model.mtp_num_steps=0"]


def record_compiles(monkeypatch) -> list:
    """(lowered, compiled) of every compile run from here on, in order."""
    compiles = []
    compile_lowered = jax.stages.Lowered.compile

    def recording_compile(lowered, *args, **kwargs):
        compiles.append((lowered, compile_lowered(lowered, *args, **kwargs)))
        return compiles[-1][1]

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording_compile)
    return compiles


@pytest.mark.slow
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, mesh", [
    ("v5p-8", ["mesh.fsdp=4", "optim.name=muon"]),  # the recipes' jnp sparse attention and Muon
    ("v6e-8", ["mesh.fsdp=4", "mesh.data=2", *PALLAS_DSA, "model.pallas_platform=tpu", *ONE_MOE_LAYER])])
def test_compile_prints_xla_memory_and_fits(topology, mesh, capsys, monkeypatch):
    compiles = record_compiles(monkeypatch)  # the step is compiled once, by the command
    built = record_built_steps(monkeypatch)
    config = str(REPO / "configs" / "tiny.yaml")
    code = main(["compile", config, "--topology", topology, *SMALL, *mesh, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["fits"] and "fits" in out
    assert report["chips"] == get_topology(topology).num_chips

    # What it compiled is the one step `abstract_train_step` built from the file and overrides, for the
    # topology's devices (tracing and lowering the step again to compare programs would take seconds), and it
    # printed XLA's memory analysis of it.
    assert len(compiles) == 1 and len(built) == 1, (len(compiles), len(built))
    lowered, compiled = compiles[0]
    (cfg, devices), = built
    assert cfg == load_experiment(config, [*SMALL, *mesh])
    expected = get_topology(topology).devices()  # the same chips (a new description: other objects)
    assert [(d.id, d.device_kind) for d in devices] == [(d.id, d.device_kind) for d in expected]
    memory = compiled.memory_analysis()
    printed = {name: int(re.search(rf"^  {name}\s+([\d,]+) bytes", out, re.M).group(1).replace(",", ""))
               for name in ("arguments", "outputs", "temporaries", "aliased")}
    assert printed == {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                       "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes}
    assert report["matmul_flops"] > 0 and report["collective_bytes"], report
    roof = report["roofline"]
    assert roof["bound"] in ("compute", "hbm", "collectives") and report["hbm_traffic_bytes"] > 0
    assert roof["step_s"] == max(roof["compute_s"], roof["hbm_s"], roof["collective_s"]) > 0
    assert re.search(r"^roofline: compute [\d.]+ ms, HBM [\d.]+ ms, collectives [\d.]+ ms", out, re.M)
    text = compiled.as_text()
    # The optimizer's matmuls are reported apart, every one of them attributed (no dot without its op_name).
    assert "(no metadata)" not in hlo_stats(text, report["chips"]).flops_by_source
    assert (report["optimizer_flops"] > 0) == ("optim.name=muon" in mesh), report["optimizer_flops"]
    assert re.search(r"^  the optimizer's [\d.e+]+; the model's forward and backward [\d.e+]+ = [\d.]+x", out, re.M)
    kernels = mosaic_kernels(text)
    grouped_matmuls = [name for name in kernels if name in ("gmm", "tgmm")]  # the routed experts, in both
    assert len(grouped_matmuls) >= 3 and "triton" not in text, kernels
    assert not report["kernels_without_cost"], report["kernels_without_cost"]
    dsa_kernels = len(kernels) - len(grouped_matmuls)
    assert dsa_kernels >= 4 if "model.attention_backend=pallas" in mesh else dsa_kernels == 0, kernels


def record_built_steps(monkeypatch) -> list:
    """(config, devices) of every step `glm5 compile` builds from here on."""
    from glm5_jax.parallel import aot

    built = []
    build = aot.abstract_train_step

    def recording_build(cfg, devices):
        built.append((cfg, devices))
        return build(cfg, devices)

    monkeypatch.setattr(aot, "abstract_train_step", recording_build)
    return built


def mosaic_kernels(compiled_text: str) -> list[str]:
    """Instruction names of the Mosaic kernels (tpu_custom_call) in a compiled module, numbering dropped: the
    grouped matmuls are named gmm / tgmm, the DSA kernels after the shard_map they run under."""
    names = re.findall(r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*custom_call_target="tpu_custom_call"', compiled_text,
                       re.M)
    return [re.sub(r"\.\d+$", "", name) for name in names]


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_compile_for_an_h200_cluster_splits_collectives_by_link(capsys, monkeypatch):
    # 2 nodes of 8: the fsdp groups stay within a node, the data-parallel pairs cross nodes.
    args = ["mesh.fsdp=8", "mesh.data=2", *SMALL[1:], "train.batch_size=16", *PALLAS_DSA, "model.pallas_platform=gpu",
            *ONE_MOE_LAYER]
    compiles = record_compiles(monkeypatch)
    code = main(["compile", str(REPO / "configs" / "tiny.yaml"), "--topology", "h200-16", *args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    (lowered, compiled), = compiles
    text = compiled.as_text()
    assert "tpu_custom_call" not in text
    expected = {"_forward_kernel", "_backward_kernel", "_sparse_target_kernel", "_scores_kernel"}
    assert expected <= set(triton_kernel_names(text)), triton_kernel_names(text)
    assert max(triton_shared_memory(lowered).values()) <= shared_memory_limit("h200")
    report = json.loads(out.strip().splitlines()[-1])
    assert report["fits"] and report["chips"] == 16 and report["hbm_bytes"] == CHIPS["h200"].hbm_bytes
    assert report["xla_cost_flops_loops_once"] == 0 and report["matmul_flops"] > 0  # XLA:GPU counts none
    links = report["collective_bytes_by_link"]
    assert links[INTRA_NODE] > 0 and links[INTER_NODE] > 0
    assert sum(links.values()) == pytest.approx(sum(report["collective_bytes"].values()))
    by_link = report["roofline"]["collective_s_by_link"]
    assert by_link[INTER_NODE] == pytest.approx(links[INTER_NODE] / CHIPS["h200"].inter_node_bytes_per_s)
    assert re.search(r"collectives [\d.]+ ms \(", out)


def test_gpu_cluster_names_map_to_nodes_of_eight():
    assert get_topology("h200-64").grid == "1x8x8" and get_topology("h200-64").num_chips == 64
    assert get_topology("h100-4").grid == "1x1x4"
    for bad in ("h200-12", "h100-0"):
        with pytest.raises(TopologyError, match="multiple of 8"):
            get_topology(bad)


@pytest.mark.gpu_aot
def test_gpu_devices_sit_on_nodes_of_eight():
    devices = get_topology("h100-16").devices()
    assert [d.process_index for d in devices] == [i // 8 for i in range(16)]
    assert "H100" in devices[0].device_kind


def _stats(**fields) -> HloStats:
    return HloStats(matmul_flops=0.0, collective_bytes={}, collective_counts={}, dynamic_loops=0, **fields)


def test_roofline_takes_the_largest_bound_and_each_link_at_its_bandwidth():
    chip = CHIPS["h200"]
    stats = _stats(hbm_bytes=4.8e12 * 0.5, collective_bytes_by_link={INTRA_NODE: 450e9, INTER_NODE: 50e9 * 2})
    stats.matmul_flops = 989e12 * 0.25
    roof = roofline(stats, chip, model_flops=989e12 * 0.2)
    assert roof["compute_s"] == pytest.approx(0.25) and roof["hbm_s"] == pytest.approx(0.5)
    assert roof["collective_s_by_link"] == pytest.approx({INTRA_NODE: 1.0, INTER_NODE: 2.0})
    assert roof["collective_s"] == pytest.approx(3.0) and roof["bound"] == "collectives"
    assert roof["step_s"] == pytest.approx(3.0) and roof["mfu"] == pytest.approx(0.2 / 3.0)


def test_an_mfu_above_one_is_an_error_naming_the_uncounted_kernels():
    stats = _stats(kernels_without_cost={"sparse_mla_fwd": 78})
    stats.matmul_flops = 1e12
    with pytest.raises(CompileError, match="above 100%.*sparse_mla_fwd"):
        roofline(stats, CHIPS["v5p"], model_flops=2e12)
    with pytest.raises(CompileError, match="above 100%"):  # nothing counted at all
        roofline(_stats(), CHIPS["v5p"], model_flops=2e12)


@pytest.mark.slow
def test_a_cpu_machine_starts_without_accelerator_noise_or_torch():
    # The package first (as `glm5` starts): nothing at all from libtpu or the CUDA plugin, both installed by the
    # test extra, even when libtpu describes a pod for `glm5 compile`. jax first: the package still keeps jax on
    # CPU and libtpu quiet (the plugin's import-time "cuda drivers" lines are then already out).
    env = {key: value for key, value in subprocess_env().items() if key != "JAX_PLATFORMS"}
    noise = ("Failed to find host bounds", "unexpected worker hostname", "Unable to load CUDA", "Traceback")
    # The package first, then a pod described as glm5 compile does, in one process (each start costs seconds).
    # It also does not load torch (installed by the test extra): tensorboardX would, for a second per start.
    package_then_pod = ("import sys, glm5_jax.cli, jax; print(jax.devices()[0].platform); "
                        "from glm5_jax.parallel.topology import get_topology; get_topology('v5p-8').devices(); "
                        "print(jax.devices()[0].platform); print('torch' in sys.modules)")
    for code, quiet, platforms in ((package_then_pod, noise + ("cuda drivers",), ["cpu", "cpu", "False"]),
                                   ("import jax, glm5_jax.cli; print(jax.devices()[0].platform)", noise, ["cpu"])):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == platforms
        for line in quiet:
            assert line not in result.stderr, (code, result.stderr)


def test_unknown_topology_is_refused_by_name(capsys):
    assert main(["compile", str(REPO / "configs" / "tiny.yaml"), "--topology", "v9x-12"]) == 2
    err = capsys.readouterr().err
    assert "v9x-12" in err and "v5p-128" in err
    with pytest.raises(TopologyError, match="generation"):
        get_topology("v9:2x2")


def test_rl_mode_is_refused_before_compiling():
    cfg = load_experiment(str(REPO / "configs" / "tiny.yaml"), ["train.mode=rl", "rl.loss=tis"])
    with pytest.raises(ValueError, match="train.mode='rl'"):
        abstract_train_step(cfg, jax.devices())


@pytest.mark.tpu_aot
def test_kernels_for_other_chips_are_refused_before_compiling(capsys, monkeypatch):
    compiles = record_compiles(monkeypatch)
    args = ["compile", str(REPO / "configs" / "tiny.yaml"), "--topology", "v5p-8", *PALLAS_DSA,
            "model.pallas_platform=gpu"]
    assert main(args) == 2 and compiles == []
    assert "model.pallas_platform='gpu'" in capsys.readouterr().err
