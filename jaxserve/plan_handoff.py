"""The prefill -> decode hand-off's two programs compiled for a plan's mesh at real pool shapes, and what the compiler
reported (`jaxserve plan`, jaxserve/plan.py): the export (`cache.pages_to_fp8`: one request's BF16 prefill pages, all
layers, quantized into a compact FP8 chunk; the prefill pool is read, not donated) and the import
(`cache.insert_pages` as `models.sharded.import_fn` gives it for the mesh, on TPU per device with the pages DMA'd:
the chunk written into the FP8 decode pool, donated and returned in its own layout as in
`engine.programs.Programs`, with the tag check). Neither reads the model: both compile at every layer, at the decode
pool's real size (the pages the plan says fit), so the copies of a pool shape they report are the real ones.
"""
from __future__ import annotations

import time

from jaxserve.plan_compile import MEMORY_FIELDS, PhaseCompile, _tracked_shapes, _with_shardings, moves
from jaxserve.hlo import collectives, summarize


def compile_handoff(cfg, par, spec, decode_pages: int, in_mesh: bool = False  # noqa: ANN001
                    ) -> dict[str, PhaseCompile]:
    """{"export": ..., "import": ...} of one request's hand-off (spec.prefill_context tokens: its pages, padded to a
    power of two as `Programs` buckets them) from a BF16 prefill pool (those pages for each of the mesh's DP ranks
    + a null page each) into an FP8 decode pool of `decode_pages` pages (rounded up to whole page shards). par:
    both pools' mesh and rules (the phases' meshes when colocated; a disaggregated deployment runs the same
    programs on its two meshes; the pool formats follow its platform, `sharding.pool_format`). in_mesh: lower
    inside `jax.set_mesh` (as `plan_compile.compile_phase`)."""
    import contextlib

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve.cache import init_pages, pages_to_fp8
    from jaxserve.engine.layouts import kv_layout, prefill_kv_dtype
    from jaxserve.engine.programs import _pool_shardings, bucket
    from jaxserve.models.sharded import import_fn

    dp, ps = par.size("pages"), spec.page_size
    n = bucket(-(-spec.prefill_context // ps), 1 << 30)
    src_layout = kv_layout(cfg, ps, prefill_kv_dtype(spec.kv_dtype))
    dst_layout = kv_layout(cfg, ps, spec.kv_dtype)
    pools = {}
    for name, layout, pages in (("prefill", src_layout, dp * (n + 1)), ("decode", dst_layout,
                                                                         -(-max(decode_pages, n + 1) // dp) * dp)):
        shape = jax.eval_shape(lambda layout=layout, pages=pages: init_pages(layout, pages))
        pools[name] = (_with_shardings(shape, _pool_shardings(shape, par)), _pool_shardings(shape, par))
    ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(par.mesh, P()))
    tags = jax.ShapeDtypeStruct((n,), jnp.uint32, sharding=NamedSharding(par.mesh, P()))
    out: dict[str, PhaseCompile] = {}
    with jax.set_mesh(par.mesh) if in_mesh else contextlib.nullcontext():
        t0 = time.perf_counter()
        export = jax.jit(lambda src, ids: pages_to_fp8(src, ids, dst_layout.index_dtype)).lower(
            pools["prefill"][0], ids).compile()
        out["export"] = _report(export, time.perf_counter() - t0, pools["prefill"][0])
        # the chunk as the hand-off places it on the decode mesh (`programs._on_mesh`: the export's partitioning)
        chunk = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=NamedSharding(
            par.mesh, sh.spec if isinstance(sh, NamedSharding) else P())),
            jax.eval_shape(lambda: init_pages(dst_layout, n)), export.output_shardings)
        t0 = time.perf_counter()
        insert = jax.jit(import_fn(par), donate_argnums=(0,), out_shardings=pools["decode"][1]).lower(
            pools["decode"][0], chunk, ids, tags, tags, ids).compile()
        out["import"] = _report(insert, time.perf_counter() - t0, pools["decode"][0])
    return out


def _report(compiled, seconds: float, pool) -> PhaseCompile:  # noqa: ANN001
    """memory_analysis, collectives and the moves of `pool`'s shapes (whole or one layer) in a compiled program."""
    ma = compiled.memory_analysis()
    hlo = compiled.as_text()
    return PhaseCompile(seconds, {f: int(getattr(ma, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS},
                        summarize(collectives(hlo)), moves(hlo, _tracked_shapes({}, pool)))
