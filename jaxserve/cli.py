"""The `jaxserve` command: convert, quantize, generate, serve, router, eval-quality, plan.

Each subcommand's arguments and body live with what it drives (`add_arguments(parser)` + `run(args) -> int`);
this module only wires them and turns typed errors into a one-line message and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from jaxserve.errors import JaxserveError

# subcommand -> (module with add_arguments/run, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("jaxserve.convert.converter", "HF safetensors folder -> jaxserve Orbax checkpoint"),
    "quantize": ("jaxserve.quant.checkpoint", "write FP8 prefill / INT4 decode weights beside a checkpoint"),
    "generate": ("jaxserve.engine.generate", "generate a continuation of a prompt (default: the embedded model)"),
    "serve": ("jaxserve.server.main", "serve the OpenAI-compatible HTTP API (default: the embedded model)"),
    "router": ("jaxserve.server.pd_main", "an OpenAI-compatible front end routing over prefill and decode servers"),
    "eval-quality": ("jaxserve.eval.quality", "compare weight and KV formats on held-out text"),
    "plan": ("jaxserve.plan", "per-device weights, temporaries, KV tokens and collectives of a model on N devices"),
}


def default_checkpoint() -> Path:
    """The embedded tiny Kimi-architecture model: checkpoints/tiny-kimi of a source checkout (editable install),
    or the same files installed as package data `jaxserve/embedded/tiny-kimi` (pyproject.toml maps checkpoints/
    to the package jaxserve.embedded)."""
    here = Path(__file__).resolve().parent
    installed = here / "embedded" / "tiny-kimi"
    return installed if installed.is_dir() else here.parent / "checkpoints" / "tiny-kimi"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA inference server for Kimi and GLM MoE models")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(module=module)
        try:
            importlib.import_module(module).add_arguments(sp)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise  # a missing dependency, not a missing subcommand
            sp.set_defaults(module=None)  # a subcommand whose module is not built yet
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.module is None:
        print(f"jaxserve {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        return importlib.import_module(args.module).run(args)
    except JaxserveError as e:
        print(f"jaxserve {args.command}: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
