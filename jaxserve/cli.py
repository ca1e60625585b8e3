"""The `jaxserve` command: convert, quantize, generate, serve, eval-quality."""
from __future__ import annotations

import argparse
import sys

from jaxserve.errors import JaxserveError


def _convert(args: argparse.Namespace) -> int:
    from checkpoints.convert import convert

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="HF safetensors folder -> jaxserve Orbax checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    c.set_defaults(func=_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except JaxserveError as e:
        print(f"jaxserve {args.command}: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
