"""Command line: `glm5 params CONFIG`, `glm5 train CONFIG [key=value ...]`, `glm5 plan CONFIG ...`,
`glm5 compile CONFIG --topology NAME ...`."""

from __future__ import annotations

import argparse
import sys

from glm5_jax.config import ConfigError, load_model_config


def _cmd_params(args) -> int:
    from glm5_jax.model.param_count import count_params

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


SUBCOMMAND_MODULES = {"train": "glm5_jax.train.runner", "plan": "glm5_jax.parallel.plan",
                      "compile": "glm5_jax.parallel.aot", "import-hf": "glm5_jax.convert.import_command",
                      "export-hf": "glm5_jax.convert.export_command"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMAND_MODULES:  # these parse their own arguments (and --help)
        return __import__(SUBCOMMAND_MODULES[argv[0]], fromlist=["main"]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="glm5", description="GLM-5 in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="parameter counts of a config, from shapes only (no weights allocated)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value overrides of model fields")
    p.set_defaults(func=_cmd_params)
    for name in SUBCOMMAND_MODULES:
        sub.add_parser(name, help=f"see `glm5 {name} --help`")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"glm5: configuration error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
