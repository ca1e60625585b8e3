"""`jaxserve generate`: one prompt through the engine, the continuation streamed to stdout."""
from __future__ import annotations

import argparse
import sys

from jaxserve.engine.compile_cache import add_cache_arguments, enable_from_args
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request, SamplingParams
from jaxserve.format_names import canonical_format


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="a converted checkpoint (default: the embedded model)")
    p.add_argument("--prompt", required=True, help="text; '\\n' escapes are honoured")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-dtype", type=canonical_format, choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--decode-weights", type=canonical_format, choices=["int4", "fp8", "bf16"], default="int4")
    p.add_argument("--prefill-weights", type=canonical_format, choices=["fp8", "bf16"], default="fp8")
    add_cache_arguments(p)


def run(args: argparse.Namespace) -> int:
    from jaxserve.cli import default_checkpoint

    enable_from_args(args)  # before anything compiles: a second run loads the programs instead
    cfg = EngineConfig(kv_dtype=args.kv_dtype, decode_weights=args.decode_weights,
                       prefill_weights=args.prefill_weights, num_decode_pages=256, num_prefill_pages=256,
                       max_batch=1, max_model_len=1024)
    engine = Engine.from_checkpoint(args.checkpoint or default_checkpoint(), cfg, start=False)
    prompt = args.prompt.encode().decode("unicode_escape") if "\\" in args.prompt else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    sys.stdout.write(prompt)
    for ev in engine.submit(Request(engine.encode(prompt), params)):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        if ev.error is not None:
            print(f"\njaxserve generate: error: {ev.error.message}", file=sys.stderr)
            return 2
    sys.stdout.write("\n")
    return 0
