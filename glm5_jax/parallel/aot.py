"""`glm5 compile CONFIG --topology NAME [k=v ...]`: compile the exact training step `glm5 train` would run,
for a TPU pod or a GPU cluster, on a machine without one (libtpu or the CUDA plugin describes the devices;
XLA's TPU compiler and Mosaic, or XLA's GPU compiler and Triton, run for real).

Nothing is allocated: parameters, optimizer state and the batch are `jax.ShapeDtypeStruct`s carrying the
shardings `glm5 train` gives them. The report, per chip: compiled memory (arguments, outputs, temporaries,
aliased donations) against the chip's HBM; matmul FLOPs (Pallas kernels' declared costs included), HBM bytes
and collective bytes by kind, by source and (GPU) by link, from the compiled HLO, every loop body counted as
often as it runs (`hlo_stats`); `glm5 plan`'s memory estimate against the compiled figure; and a roofline:
compute time at the chip's peak, HBM bytes over its bandwidth, collective bytes over its links (GPU: NVLink
within a node, the inter-node network across), the largest being the bound, and the MFU that step time gives.
An MFU above 100% means a counter missed work: it is an error, never a figure.
"""

from __future__ import annotations

import math
import time

import jax

from glm5_jax.config.experiment import ExperimentConfig
from glm5_jax.model.flops import training_flops_per_token
from glm5_jax.parallel.hlo_stats import INTER_NODE, INTRA_NODE, HloStats, flops_in_scope, hlo_stats
from glm5_jax.parallel.plan import PlanSettings, plan
from glm5_jax.parallel.topology import GIB, ChipSpec, Topology
from glm5_jax.parallel.trainer import build_trainer
from glm5_jax.train.step import OPTIMIZER_SCOPE


TOP_SOURCES = 8  # FLOPs and collective bytes are attributed to the JAX operations they came from, largest first


class CompileError(ValueError):
    """The step cannot be compiled as asked."""


def abstract_train_step(cfg: ExperimentConfig, devices):
    """(jitted step, abstract state, abstract batch, mesh) of the trainer `glm5 train` builds, over `devices`."""
    if cfg.train.mode == "rl":
        raise CompileError("train.mode='rl' is invalid for glm5 compile: its batch layout comes from stored "
                           "rollouts; compile the same model in mode pretrain or sft")
    trainer = build_trainer(cfg, devices)
    return trainer.step.jitted, trainer.abstract_state(), trainer.abstract_batch(), trainer.mesh


def compile_report(cfg: ExperimentConfig, topology: Topology, hlo_path: str | None = None) -> dict:
    """Compile `cfg`'s training step for `topology` and return the per-chip figures (and write the compiled
    HLO text to `hlo_path` when given)."""
    devices = topology.devices()
    jitted, state, batch, mesh = abstract_train_step(cfg, devices)
    start = time.perf_counter()
    try:
        compiled = jitted.trace(state, batch).lower().compile()
    except jax.errors.JaxRuntimeError as err:
        # XLA:TPU refuses outright a program whose buffers cannot fit; that is a verdict, not a crash.
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return {"topology": topology.name, "chips": len(devices), "chip": topology.chip.generation,
                "mesh": dict(mesh.shape), "batch": cfg.train.batch_size, "seq": cfg.train.seq_len, "fits": False,
                "hbm_bytes": topology.chip.hbm_bytes, "compiler_refusal": str(err).splitlines()[0][:500],
                "compile_seconds": round(time.perf_counter() - start, 1)}
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}  # XLA:GPU reports none
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    chip = topology.chip
    # Collectives across nodes are split out only where nodes are joined by a slower network (GPU clusters).
    nodes = [device.process_index for device in mesh.devices.flat] if chip.inter_node_bytes_per_s else None
    stats = hlo_stats(text, len(devices), node_of_device=nodes)
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
             - memory.alias_size_in_bytes)
    mesh_cfg = cfg.mesh.resolve(len(devices))
    planned = plan(cfg.model, mesh_cfg, PlanSettings(batch=cfg.train.batch_size, seq=cfg.train.seq_len,
                                                     optimizer=cfg.optim.name, mu_dtype=cfg.optim.mu_dtype,
                                                     device_memory_gib=chip.hbm_bytes / GIB))
    tokens = cfg.train.batch_size * cfg.train.seq_len
    model_flops_per_chip = training_flops_per_token(cfg.model, cfg.train.seq_len) * tokens / len(devices)
    return {
        "topology": topology.name, "chips": len(devices), "chip": chip.generation,
        "mesh": dict(mesh.shape), "batch": cfg.train.batch_size, "seq": cfg.train.seq_len,
        "compile_seconds": round(seconds, 1),
        "memory_bytes": {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                         "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes,
                         "generated_code": memory.generated_code_size_in_bytes, "total": total},
        "hbm_bytes": chip.hbm_bytes, "fits": total <= chip.hbm_bytes,
        "matmul_flops": stats.matmul_flops, "optimizer_flops": flops_in_scope(stats, OPTIMIZER_SCOPE),
        "kernel_flops": stats.kernel_flops,
        "kernels_without_cost": stats.kernels_without_cost,
        "xla_cost_flops_loops_once": float(cost.get("flops", 0.0)),
        "model_flops": model_flops_per_chip, "hbm_traffic_bytes": stats.hbm_bytes,
        "xla_cost_bytes_loops_once": float(cost.get("bytes accessed", 0.0)),
        "collective_bytes": stats.collective_bytes, "collective_counts": stats.collective_counts,
        "collective_bytes_by_link": stats.collective_bytes_by_link,
        "dynamic_loops_counted_once": stats.dynamic_loops,
        # The grouped matmuls declare the work of an even load's row tiles (`DispatchLayout.expected_rows`); a
        # chip whose experts draw more (up to the receive buffers' capacity) does more, another less.
        "expert_capacity_factor": cfg.model.moe_capacity_factor if cfg.model.moe_backend == "ep" else None,
        "matmul_flops_by_source": dict(list(stats.flops_by_source.items())[:TOP_SOURCES]),
        "collective_bytes_by_source": dict(list(stats.collective_bytes_by_source.items())[:TOP_SOURCES]),
        "hbm_bytes_by_source": dict(list(stats.hbm_bytes_by_source.items())[:TOP_SOURCES]),
        "plan_total_bytes": planned["memory_bytes"]["total"], "plan_over_compiled": planned["memory_bytes"]["total"] / total,
        "roofline": roofline(stats, chip, model_flops_per_chip),
    }


def roofline(stats: HloStats, chip: ChipSpec, model_flops: float) -> dict:
    """Seconds per step at each bound (compute, HBM, collectives), the largest being the step, and the MFU it
    gives. Raises CompileError when the MFU would exceed 100%: the counted work is below the model's."""
    link_seconds = {INTRA_NODE: chip.ici_bytes_per_s, INTER_NODE: chip.inter_node_bytes_per_s}
    collective = {link: sent / link_seconds[link] for link, sent in stats.collective_bytes_by_link.items() if sent}
    times = {"compute": stats.matmul_flops / chip.peak_bf16_flops, "hbm": stats.hbm_bytes / chip.hbm_bytes_per_s,
             "collectives": sum(collective.values())}
    bound = max(times, key=times.get)
    step_s = times[bound]
    if step_s:
        mfu = model_flops / (chip.peak_bf16_flops * step_s)
    else:  # nothing counted at all: any model work was missed
        mfu = math.inf if model_flops else 0.0
    if mfu > 1.0:
        missing = (f"; Pallas kernels without a declared cost: {stats.kernels_without_cost}"
                   if stats.kernels_without_cost else "")
        raise CompileError(f"roofline MFU {mfu:.0%} is above 100%: the compiled step's counted matmul FLOPs "
                           f"({stats.matmul_flops:.4g} per chip) are below the model's ({model_flops:.4g}), so a "
                           f"counter missed work{missing}")
    return {"compute_s": times["compute"], "hbm_s": times["hbm"], "collective_s": times["collectives"],
            "collective_s_by_link": collective, "step_s": step_s, "bound": bound, "mfu": mfu}


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def format_report(report: dict, config_path: str) -> str:
    if "compiler_refusal" in report:
        return (f"config:       {config_path}\ntopology:     {report['topology']} ({report['chips']} {report['chip']} "
                f"chips), mesh {report['mesh']}\nDOES NOT FIT: XLA refused to compile: {report['compiler_refusal']}")
    mem, roof = report["memory_bytes"], report["roofline"]
    lines = [
        f"config:       {config_path}",
        f"topology:     {report['topology']} ({report['chips']} {report['chip']} chips), mesh {report['mesh']}, "
        f"batch {report['batch']} x {report['seq']} tokens; compiled in {report['compile_seconds']} s",
        "per-chip memory (XLA memory_analysis):",
        f"  arguments     {mem['arguments']:>16,} bytes  ({_gib(mem['arguments'])})",
        f"  outputs       {mem['outputs']:>16,} bytes  ({_gib(mem['outputs'])})",
        f"  temporaries   {mem['temporaries']:>16,} bytes  ({_gib(mem['temporaries'])})",
        f"  aliased       {mem['aliased']:>16,} bytes  ({_gib(mem['aliased'])}, donated state reused)",
        f"  total         {mem['total']:>16,} bytes  ({_gib(mem['total'])}) of {_gib(report['hbm_bytes'])} HBM: "
        + ("fits" if report["fits"] else "DOES NOT FIT"),
        f"glm5 plan estimate: {_gib(report['plan_total_bytes'])} = {report['plan_over_compiled']:.2f}x compiled",
        f"per-chip matmul FLOPs: {report['matmul_flops']:.4g} (model FLOPs {report['model_flops']:.4g}; Pallas "
        f"kernels' declared {report['kernel_flops']:.4g}; XLA cost_analysis, loop bodies once: "
        f"{report['xla_cost_flops_loops_once']:.4g})",
        f"  the optimizer's {report['optimizer_flops']:.4g}; the model's forward and backward "
        f"{report['matmul_flops'] - report['optimizer_flops']:.4g} = "
        f"{(report['matmul_flops'] - report['optimizer_flops']) / report['model_flops']:.3f}x the model count; "
        "largest sources:",
    ]
    for source, flops in report.get("matmul_flops_by_source", {}).items():
        lines.append(f"  {flops / report['matmul_flops']:6.1%}  {flops:.3g}  {source}")
    if report["kernels_without_cost"]:
        lines.append(f"  NOT COUNTED: Pallas kernels without a declared cost (name: executions): "
                     f"{report['kernels_without_cost']}")
    if report.get("expert_capacity_factor"):
        lines.append(f"  (routed experts counted at an even load: a chip whose experts draw their receive buffers' "
                     f"whole capacity, {report['expert_capacity_factor']:g}x, does that much more of their work)")
    lines.append(f"per-chip HBM traffic: {report['hbm_traffic_bytes']:,.0f} bytes (XLA cost_analysis, loop bodies "
                 f"once: {report['xla_cost_bytes_loops_once']:,.0f}); largest sources:")
    for source, traffic in report.get("hbm_bytes_by_source", {}).items():
        lines.append(f"  {traffic / max(report['hbm_traffic_bytes'], 1):6.1%}  {traffic:.3g}  {source}")
    lines.append("per-chip collective bytes sent (ring):")
    for kind, sent in sorted(report["collective_bytes"].items()):
        lines.append(f"  {kind:<18} {sent:>16,.0f} bytes in {report['collective_counts'][kind]} ops")
    if len(report["collective_bytes_by_link"]) > 1 or INTER_NODE in report["collective_bytes_by_link"]:
        for link, sent in sorted(report["collective_bytes_by_link"].items()):
            lines.append(f"  {link:<18} {sent:>16,.0f} bytes")
    if report["dynamic_loops_counted_once"]:
        lines.append(f"  ({report['dynamic_loops_counted_once']} loops with data-dependent trip counts "
                     "counted once)")
    total_sent = sum(report["collective_bytes"].values())
    if total_sent:
        lines.append("  largest sources:")
        for source, sent in report["collective_bytes_by_source"].items():
            lines.append(f"  {sent / total_sent:6.1%}  {sent:.3g}  {source}")
    links = ", ".join(f"{link} {seconds * 1e3:.2f} ms" for link, seconds in roof["collective_s_by_link"].items())
    by_link = f" ({links})" if len(roof["collective_s_by_link"]) > 1 else ""
    lines.append(f"roofline: compute {roof['compute_s'] * 1e3:.2f} ms, HBM {roof['hbm_s'] * 1e3:.2f} ms, collectives "
                 f"{roof['collective_s'] * 1e3:.2f} ms{by_link} -> {roof['bound']}-bound step "
                 f"{roof['step_s'] * 1e3:.2f} ms, MFU {roof['mfu']:.1%}")
    return "\n".join(lines)
