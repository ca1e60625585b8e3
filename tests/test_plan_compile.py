"""jaxserve.plan_compile's pool-copy search on hand-written HLO text: a fusion that writes a whole pool layer (the
`slice` fusion XLA:GPU made to hand a kernel `pages.layer(i)`) is a pool move, an in-place update of the pool is
not, and `copy` ops are found as before."""
from __future__ import annotations

from jaxserve.hlo_bytes import traffic
from jaxserve.plan_compile import fusion_copies, moves

LAYER = 4 * 1024  # u8[4,1024]: one layer of a 2-layer u8[2,4,1024] pool
MODULE = """HloModule m

%fused_layer (param_0: u8[2,4,1024], param_1: s32[]) -> u8[1,4,1024] {
  %param_0 = u8[2,4,1024]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = u8[1,4,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,4,1024}
}

%fused_write (param_0.1: u8[2,4,1024], param_1.1: u8[1,1,1024], param_2.1: s32[]) -> u8[2,4,1024] {
  %param_0.1 = u8[2,4,1024]{2,1,0} parameter(0)
  %param_1.1 = u8[1,1,1024]{2,1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  ROOT %dus = u8[2,4,1024]{2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %c.1, %c.1)
}

ENTRY %main (pool: u8[2,4,1024], row: u8[1,1,1024], i: s32[]) -> (u8[2,4,1024], f32[8]) {
  %pool = u8[2,4,1024]{2,1,0} parameter(0)
  %row = u8[1,1,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %upd = u8[2,4,1024]{2,1,0} fusion(%pool, %row, %i), kind=kLoop, calls=%fused_write
  %layer = u8[1,4,1024]{2,1,0} fusion(%upd, %i), kind=kLoop, calls=%fused_layer, metadata={op_name="jit(f)/slice"}
  %k = f32[8]{0} custom-call(%layer), custom_call_target="__gpu$xla.gpu.triton"
  %cp = u8[2,4,1024]{2,1,0} copy(%upd)
  ROOT %t = (u8[2,4,1024]{2,1,0}, f32[8]{0}) tuple(%cp, %k)
}
"""
TRACKED = {(2, 4, 1024): "pool.latent (all layers)", (4, 1024): "pool.latent"}


def test_a_fusion_copying_a_pool_layer_is_a_pool_move_and_an_in_place_write_is_not():
    got = fusion_copies(traffic(MODULE), TRACKED)
    assert got == [{"op": "fusion", "of": "pool.latent", "dtype": "u8", "shape": [1, 4, 1024], "layout": "",
                    "count": 1, "bytes": LAYER}]


def test_copy_ops_are_still_found():
    assert [(m["op"], m["of"], m["count"]) for m in moves(MODULE, TRACKED)] == [
        ("copy", "pool.latent (all layers)", 1)]
