"""The `glm5` command line; this module owns the argument parsing of every subcommand:

    glm5 params CONFIG [key=value ...]
    glm5 train CONFIG [section.key=value ...] [--allow-config-change]
    glm5 plan CONFIG [mesh.<axis>=N ...] [batch=N seq=N remat=... optimizer=... mu_dtype=... device_memory_gib=X]
              [model.key=value ...]
    glm5 compile CONFIG --topology NAME [section.key=value ...] [--json] [--hlo-out FILE]
    glm5 import-hf HF_DIR RUN_DIR [mesh.<axis>=N ...] [--param-dtype D] [--compute-dtype D] [--fp8-dtype D]
                   [--host-budget-gb 8]
    glm5 export-hf RUN_DIR OUT_DIR [mesh.<axis>=N ...] [--max-shard-size 5GB] [--step N] [--no-mtp]
    glm5 generate SOURCE [mesh.<axis>=N ...] (--prompt TEXT | --prompts FILE.jsonl) [--max-new-tokens N]
                  [--temperature T] [--top-p P] [--seed S] [--chat] [--thinking on|off|interleaved]
                  [--speculative N] [--json] [--batch-size N] [--step N] [--tokenizer SPEC]
    glm5 eval SOURCE DATA [key=value ...] [--mode pretrain|sft] [--batches N] [--step N] [--tokenizer SPEC]
    glm5 rollout SOURCE PROMPTS.jsonl --out FILE --reward module:function [--samples N] [--append] [--routing]
                 [sampling and prompt options as generate] [--batch-prompts N]
    glm5 rl-async CONFIG [section.key=value ...]

A user error (config, data, resume, lock, plan settings, ...) ends with one `glm5 <command>: ...` line naming
the file or field, the value and what is valid, and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

from glm5_jax.commands import evaluate, generate, prompts, rl_async, rollout  # their docstrings are the --help texts
from glm5_jax.commands.evaluate import EVAL_MODES, eval_config, run_eval
from glm5_jax.commands.generate import GenerateOptions, run_generate
from glm5_jax.commands.prompts import THINKING_MODES, read_prompts
from glm5_jax.commands.rollout import check_out, load_reward, run_rollout
from glm5_jax.commands.source import load_source, stop_ids
from glm5_jax.config import DTYPES, ConfigError, from_dict, load_model_config, parse_overrides
from glm5_jax.config.experiment import load_experiment
from glm5_jax.config.mesh import MeshConfig
from glm5_jax.convert.run_dir import mesh_from_overrides, parse_size, restore_run_params
from glm5_jax.convert.sharded_export import export_hf
from glm5_jax.convert.streaming_import import import_hf, save_imported
from glm5_jax.distributed.runtime import DistributedError
from glm5_jax.generation import SamplingParams
from glm5_jax.model.param_count import count_params
from glm5_jax.parallel import aot, plan
from glm5_jax.parallel.topology import TopologyError, get_topology
from glm5_jax.runner import TrainingError, run
from glm5_jax.train.run_lock import RunLockedError

PLAN_USAGE = ("usage: glm5 plan CONFIG [mesh.data=N mesh.fsdp=N mesh.expert=N mesh.context=N mesh.tensor=N] "
              "[batch=N seq=N remat=none|full|dots|dots_no_batch optimizer=adamw|muon mu_dtype=float32|bfloat16 "
              "device_memory_gib=X] [model.key=value ...]")


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def _cmd_params(args) -> int:
    config = load_model_config(args.config, args.overrides)
    counts = count_params(config)
    print(f"config:              {args.config}")
    print(f"total:               {counts['total']:,}  ({counts['total'] / 1e9:.1f}B, every stored tensor incl. "
          "MTP and router correction biases)")
    print(f"total without MTP:   {counts['without_mtp']:,}  ({counts['without_mtp'] / 1e9:.1f}B)")
    print(f"MTP module:          {counts['mtp']:,}")
    print(f"active per token:    {counts['active_per_token']:,}  ({counts['active_per_token'] / 1e9:.1f}B, "
          "main model)")
    return 0


def _cmd_train(args) -> int:
    cfg = load_experiment(args.config, args.overrides)
    run(cfg, allow_config_change=args.allow_config_change)
    return 0


def parse_plan_items(items: list[str]) -> tuple[MeshConfig, plan.PlanSettings, list[str]]:
    """`glm5 plan`'s key=value items: mesh.<axis>, plan settings, anything else a model override."""
    settings_fields = [field.name for field in dataclasses.fields(plan.PlanSettings)]
    try:
        values = parse_overrides(items, usage="key=value, e.g. mesh.fsdp=8 or batch=16")
        settings = from_dict(plan.PlanSettings, {k: v for k, v in values.items() if k in settings_fields})
    except ConfigError as err:
        raise plan.PlanError(str(err)) from None
    mesh = values.get("mesh", {})
    if not isinstance(mesh, dict):
        raise plan.PlanError(f"mesh={mesh!r} is invalid: give each axis its size, e.g. mesh.fsdp=8")
    model_items = [item for item in items if item.partition("=")[0].split(".")[0] not in ("mesh", *settings_fields)]
    return MeshConfig.from_mapping(mesh), settings.validate(), model_items


def _cmd_plan(args) -> int:
    if "=" in args.config:
        raise plan.PlanError(f"CONFIG is missing: {PLAN_USAGE}")
    mesh, settings, overrides = parse_plan_items(args.items)
    report = plan.plan(load_model_config(args.config, overrides), mesh, settings)
    print(plan.format_report(report, args.config))
    print(json.dumps(report))
    return 0


def _cmd_compile(args) -> int:
    topology = get_topology(args.topology)
    cfg = load_experiment(args.config, args.overrides)
    report = aot.compile_report(cfg, topology, hlo_path=args.hlo_out)
    print(aot.format_report(report, args.config))
    if args.json:
        print(json.dumps(report))
    return 0 if report["fits"] else 1


def _cmd_import_hf(args) -> int:
    start = time.perf_counter()
    imported = import_hf(args.hf_dir, mesh=mesh_from_overrides(args.mesh), param_dtype=args.param_dtype,
                         compute_dtype=args.compute_dtype, fp8_dtype=args.fp8_dtype,
                         host_budget_bytes=max(1, int(args.host_budget_gb * 2**30)))
    loaded = time.perf_counter() - start
    save_imported(imported, args.run_dir, source=args.hf_dir)
    print(f"dtypes: {imported.dtype_note}")
    if imported.dequantized:
        print(f"dequantized {len(imported.dequantized)} FP8 tensors to {args.fp8_dtype}, e.g. "
              f"{imported.dequantized[:3]} (full list in the checkpoint's config item)")
    print(f"read in {loaded:.1f}s, saved in {time.perf_counter() - start - loaded:.1f}s; peak host memory "
          f"{_peak_rss_gib():.2f} GiB")
    print(f"wrote {Path(args.run_dir) / 'checkpoints'} and {Path(args.run_dir) / 'model.yaml'}")
    return 0


def _cmd_export_hf(args) -> int:
    params, config = restore_run_params(Path(args.run_dir), mesh_from_overrides(args.mesh), args.step)
    files = export_hf(params, config, args.out_dir, max_shard_bytes=parse_size(args.max_shard_size),
                      include_mtp=not args.no_mtp)
    print(f"wrote {len(files)} safetensors files to {args.out_dir}; peak host memory {_peak_rss_gib():.2f} GiB")
    return 0


def _sampling_options(args, source, collect_routing: bool = False) -> GenerateOptions:
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                              eos_ids=stop_ids(source))
    return GenerateOptions(sampling=sampling, seed=args.seed, speculative=args.speculative,
                           batch_size=getattr(args, "batch_size", 0), collect_routing=collect_routing)


def _prompts(args, source, path: str | None):
    return read_prompts(text=getattr(args, "prompt", None), path=path, tokenizer=source.tokenizer,
                        vocab_size=source.config.vocab_size, chat=args.chat, thinking=args.thinking)


def _cmd_generate(args) -> int:
    source = load_source(args.source, step=args.step, mesh_items=args.mesh, tokenizer=args.tokenizer)
    run_generate(source, _prompts(args, source, args.prompts), _sampling_options(args, source), as_json=args.json,
                 out=sys.stdout, log=sys.stderr)  # the streams of now, for a caller that redirects them
    return 0


def _cmd_eval(args) -> int:
    mesh_items = [item for item in args.overrides if item.startswith("mesh.")]
    source = load_source(args.source, step=args.step, mesh_items=mesh_items, tokenizer=args.tokenizer)
    cfg = eval_config(source, args.data, [o for o in args.overrides if not o.startswith("mesh.")], args.mode)
    summary = run_eval(source, cfg, batches=args.batches, log=sys.stderr)
    print(json.dumps(summary))
    return 0


def _cmd_rollout(args) -> int:
    # A missing reward function or an --out that is in the way is refused before any model is read.
    reward = load_reward(args.reward)
    existing = check_out(Path(args.out), args.append)
    source = load_source(args.source, step=args.step, mesh_items=args.mesh, tokenizer=args.tokenizer)
    options = _sampling_options(args, source, collect_routing=args.routing)
    summary = run_rollout(source, _prompts(args, source, args.prompts), options, reward=reward,
                          samples=args.samples, out=Path(args.out), existing=existing,
                          batch_prompts=args.batch_prompts, log=sys.stderr)
    print(json.dumps(summary))
    return 0


def _cmd_rl_async(args) -> int:
    config = rl_async.load_rl_async(args.config, args.overrides)
    summary = rl_async.run_in_run_dir(config, log=lambda row: print(json.dumps(row), flush=True))
    print("summary: " + json.dumps(summary))
    return 0


def _add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run directory (glm5 train / glm5 import-hf) or a Hugging Face checkpoint "
                                  "directory (config.json + safetensors)")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=int, help="checkpoint step of a run directory (default: the latest)")
    p.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the run's data.tokenizer, an HF "
                                       "directory's tokenizer.json, else byte)")


def _add_sampling(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", type=int, default=0, metavar="N",
                   help="draft N tokens per step with the MTP module (same distribution; greedy: same tokens)")
    p.add_argument("--chat", action="store_true", help="render text prompts as a user message through the GLM-5 "
                                                       "chat template ('messages' lines always are)")
    p.add_argument("--thinking", choices=THINKING_MODES, default="on",
                   help="chat: think (on), do not (off), or think keeping earlier turns' reasoning (interleaved)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5", description="GLM-5 in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("params", help="parameter counts of a config, from shapes only (no weights allocated)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides of model fields")
    p.set_defaults(func=_cmd_params, errors=(ConfigError,))

    p = sub.add_parser("train", help="run an experiment from a config file", description="Run an experiment "
                       "from a config file.")
    p.add_argument("config", help="experiment YAML (sections model/optim/train/data/checkpoint)")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=20")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume although the config differs from the checkpoint's (beyond steps, logging, "
                        "checkpoint cadence)")
    p.set_defaults(func=_cmd_train,
                   errors=(ConfigError, TrainingError, RunLockedError, ValueError, DistributedError))

    p = sub.add_parser("plan", help="per-device memory and communication of a config on a mesh, on paper",
                       description=plan.__doc__, usage=PLAN_USAGE[len("usage: "):],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("items", nargs="*", help="mesh.<axis>=N, plan settings, model.key=value overrides")
    p.set_defaults(func=_cmd_plan, errors=(plan.PlanError, ConfigError, ValueError))

    p = sub.add_parser("compile", help="AOT-compile the training step for a TPU pod or GPU cluster here",
                       description=aot.__doc__.split("\n\n")[0])
    p.add_argument("config", help="experiment YAML (the one `glm5 train` would run)")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. mesh.fsdp=64 train.batch_size=128")
    p.add_argument("--topology", required=True, help="Cloud TPU name (v5p-128, v6e-256, ...), GEN:GRID, or a "
                   "GPU cluster h100-N / h200-N (N GPUs, 8 per node)")
    p.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    p.add_argument("--hlo-out", metavar="FILE", help="write the compiled per-chip HLO text to FILE")
    p.set_defaults(func=_cmd_compile, errors=(ConfigError, aot.CompileError, TopologyError, ValueError),
                   intermixed_parser=p)

    p = sub.add_parser("import-hf", help="import a Hugging Face GLM-5 checkpoint into a run directory",
                       description="Import a Hugging Face GLM-5 checkpoint directory (bf16, fp32 or block-scaled "
                       "FP8) into an orbax checkpoint that `glm5 train ... train.init_from=RUN_DIR` starts from.")
    p.add_argument("hf_dir")
    p.add_argument("run_dir")
    p.add_argument("mesh", nargs="*", help="mesh.<axis>=N (data, fsdp, expert, tensor); default one device")
    p.add_argument("--param-dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    p.add_argument("--compute-dtype", choices=DTYPES, help="default: the checkpoint's config.json dtype")
    p.add_argument("--fp8-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="what FP8 weights are dequantized to")
    p.add_argument("--host-budget-gb", type=float, default=8.0,
                   help="device slices built on the host at once (slices sharing layers/experts are built "
                        "together so each tensor is read once)")
    p.set_defaults(func=_cmd_import_hf, errors=(ValueError, FileExistsError))

    p = sub.add_parser("export-hf", help="export a run's parameters as a sharded Hugging Face checkpoint",
                       description="Export a run directory's parameters as a sharded Hugging Face checkpoint "
                       "(released layout, MTP included).")
    p.add_argument("run_dir", help="holds checkpoints/ and model.yaml (an import) or config.yaml (a run)")
    p.add_argument("out_dir")
    p.add_argument("mesh", nargs="*", help="mesh.<axis>=N to restore onto; default one device")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--step", type=int, help="default: the latest")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    p.set_defaults(func=_cmd_export_hf, errors=(ValueError,))

    p = sub.add_parser("generate", help="sample text from a run, an import or a Hugging Face checkpoint",
                       description=generate.__doc__ + "\n" + prompts.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_source(p)
    p.add_argument("mesh", nargs="*", help="mesh.<axis>=N (default: the run's mesh: section)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="one prompt text")
    prompt.add_argument("--prompts", metavar="FILE.jsonl", help="one prompt object per line (see --help)")
    _add_sampling(p, temperature=1.0)
    p.add_argument("--json", action="store_true", help="one JSON record per prompt on stdout")
    p.add_argument("--batch-size", type=int, default=0, help="prompts generated together (0 = all)")
    _add_model_options(p)
    p.set_defaults(func=_cmd_generate, errors=(ValueError, FileNotFoundError), intermixed_parser=p)

    p = sub.add_parser("eval", help="held-out loss of a model on a data section", description=evaluate.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_source(p)
    p.add_argument("data", help="an experiment YAML (its data: and train: sections), a .jsonl file or a directory")
    p.add_argument("overrides", nargs="*", help="data.key=value / train.key=value (train.seq_len, "
                                                "train.batch_size, train.eval_batches) or mesh.<axis>=N")
    p.add_argument("--mode", choices=EVAL_MODES, default="pretrain",
                   help="sft: chat records, only the loss-masked tokens scored")
    p.add_argument("--batches", type=int, help="batches scored (default: train.eval_batches)")
    _add_model_options(p)
    p.set_defaults(func=_cmd_eval, errors=(ValueError, FileNotFoundError), intermixed_parser=p)

    p = sub.add_parser("rollout", help="sampled rollouts with rewards, written as RL training records",
                       description=rollout.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_source(p)
    p.add_argument("prompts", metavar="PROMPTS.jsonl")
    p.add_argument("mesh", nargs="*", help="mesh.<axis>=N (default: the run's mesh: section)")
    p.add_argument("--out", required=True, help="rollout file: .jsonl, or ArrayRecord for any other name")
    p.add_argument("--append", action="store_true", help="add to an existing --out, skipping prompts in it")
    p.add_argument("--reward", required=True, metavar="MODULE:FUNCTION",
                   help="called as function(text, prompt_record) -> number, e.g. "
                        "glm5_jax.examples.rewards:python_line")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (one group)")
    p.add_argument("--routing", action="store_true", help="record expert choices and indexer top-k for replay")
    p.add_argument("--batch-prompts", type=int, default=8, help="prompts per batch (records written per batch)")
    _add_sampling(p, temperature=1.0)
    _add_model_options(p)
    p.set_defaults(func=_cmd_rollout, errors=(ValueError, FileNotFoundError), intermixed_parser=p)

    p = sub.add_parser("rl-async", help="asynchronous off-policy RL on a task given as module:function, from a "
                       "config file", description=rl_async.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML with sections model/optim/train/rl/mesh/async/task")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. async.steps=20 task.num_digits=3")
    p.set_defaults(func=_cmd_rl_async, errors=(ValueError,))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `compile` takes --topology between its overrides; argparse mixes them only within one subparser.
        intermixed = getattr(args, "intermixed_parser", None)
        if intermixed is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        command = args.command
        args = intermixed.parse_intermixed_args(argv[argv.index(command) + 1:])
        args.command = command
    try:
        return args.func(args)
    except args.errors as err:
        print(f"glm5 {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
