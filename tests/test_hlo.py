"""jaxserve.hlo.collectives on the forms compiled HLO prints: a plain result, a combined op (a tuple of results),
and async starts (operand, result) or ((operands), (results)) as XLA:GPU prints its combined all-gathers."""
from __future__ import annotations

from jaxserve.hlo import collectives, summarize

HLO = """
  %a = f32[8,7168]{1,0} reduce-scatter(%x), channel_id=1
  %b = (bf16[8,7168]{1,0}, bf16[64,7168]{1,0}) all-gather-start(%y), channel_id=2
  %c = ((u32[1025]{0}, u8[8,576]{1,0}), (u32[8200]{0}, u8[64,576]{1,0})) all-gather-start(%t, %r), channel_id=3
  %d = (f32[64]{0}, s32[64]{0}) all-reduce(%p, %q), channel_id=4
  %e = bf16[64,7168]{1,0} all-reduce-start(%z), channel_id=5
  %f = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%w), channel_id=6
  %g = ((f32[64,7168]{1,0}), f32[8,7168]{1,0}) reduce-scatter-start(%v), channel_id=7
"""


def test_every_result_of_plain_combined_and_async_collectives():
    got = sorted((c.kind, c.dtype, c.shape) for c in collectives(HLO))
    assert got == sorted([("reduce-scatter", "f32", (8, 7168)), ("all-gather", "bf16", (64, 7168)),
                          ("all-gather", "u32", (8200,)), ("all-gather", "u8", (64, 576)),
                          ("all-reduce", "f32", (64,)), ("all-reduce", "s32", (64,)),
                          ("all-reduce", "bf16", (64, 7168)), ("collective-permute", "f32", (4,)),
                          ("reduce-scatter", "f32", (8, 7168))])
    assert sum(r["count"] for r in summarize(collectives(HLO))) == 9
