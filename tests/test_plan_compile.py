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


# XLA:TPU's shapes: a gather fusion ending in an identity transpose (the MoE's routed rows, a weight's shape by
# chance), a weight relaid out at the top level, and an FP8 weight's tiles unpacked inside a dot's fusion
TPU_MODULE = """HloModule t

%fused_gather (p0: bf16[64,6144], p1: s32[512,1]) -> bf16[512,6144] {
  %p0 = bf16[64,6144]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[512,1]{1,0:T(8,128)} parameter(1)
  %g = bf16[512,6144]{1,0:T(8,128)(2,1)} gather(%p0, %p1), offset_dims={1}, slice_sizes={1,6144}
  %tr = bf16[512,6144]{1,0:T(8,128)(2,1)} transpose(%g), dimensions={0,1}
  ROOT %r = bf16[512,6144]{1,0:T(8,128)(2,1)S(1)} reshape(%tr)
}

%unpack (input: f8e4m3fn[64,6144]) -> f8e4m3fn[64,6144] {
  %input = f8e4m3fn[64,6144]{1,0:T(32,128)(4,1)S(1)} parameter(0)
  ROOT %cp8 = f8e4m3fn[64,6144]{1,0:T(8,128)(4,1)} copy(%input)
}

%fused_dot (q0: f8e4m3fn[64,6144], q1: bf16[512,64]) -> f32[512,6144] {
  %q0 = f8e4m3fn[64,6144]{1,0:T(32,128)(4,1)S(1)} parameter(0)
  %q1 = bf16[512,64]{1,0:T(8,128)(2,1)} parameter(1)
  %un = f8e4m3fn[64,6144]{1,0:T(8,128)(4,1)} fusion(%q0), kind=kLoop, calls=%unpack
  %cv = bf16[64,6144]{1,0:T(8,128)(2,1)} convert(%un)
  ROOT %d = f32[512,6144]{1,0:T(8,128)} convolution(%q1, %cv), dim_labels=bf_io->bf
}

%fused_relayout (r0: bf16[512,6144]) -> bf16[512,6144] {
  %r0 = bf16[512,6144]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %rt = bf16[512,6144]{0,1:T(8,128)(2,1)} transpose(%r0), dimensions={0,1}
}

ENTRY %main (x: bf16[64,6144], i: s32[512,1], w: f8e4m3fn[64,6144], h: bf16[512,64], kvb: bf16[512,896], o: bf16[512,6144]) -> (bf16[512,6144], f32[512,6144], bf16[512,896], bf16[512,6144]) {
  %x = bf16[64,6144]{1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[512,1]{1,0:T(8,128)} parameter(1)
  %w = f8e4m3fn[64,6144]{1,0:T(32,128)(4,1)} parameter(2)
  %h = bf16[512,64]{1,0:T(8,128)(2,1)} parameter(3)
  %kvb = bf16[512,896]{1,0:T(8,128)(2,1)} parameter(4)
  %o = bf16[512,6144]{1,0:T(8,128)(2,1)} parameter(5)
  %rows = bf16[512,6144]{1,0:T(8,128)(2,1)S(1)} fusion(%x, %i), kind=kLoop, calls=%fused_gather
  %y = f32[512,6144]{1,0:T(8,128)} fusion(%w, %h), kind=kOutput, calls=%fused_dot
  %kt = bf16[512,896]{0,1:T(8,128)(2,1)} copy(%kvb)
  %ot = bf16[512,6144]{0,1:T(8,128)(2,1)} fusion(%o), kind=kLoop, calls=%fused_relayout
  ROOT %out = (bf16[512,6144]{1,0:T(8,128)(2,1)S(1)}, f32[512,6144]{1,0:T(8,128)}, bf16[512,896]{0,1:T(8,128)(2,1)}, bf16[512,6144]{0,1:T(8,128)(2,1)}) tuple(%rows, %y, %kt, %ot)
}
"""


def test_moves_are_relayouts_written_to_memory_not_views_or_on_chip_unpacking():
    """The weight copy at the top level and the fusion writing a transposed weight are moves; the gather fusion's
    identity transpose (a view, same layout) and the FP8 tiles unpacked inside the dot's fusion are not."""
    tracked = {(512, 6144): "weight", (64, 6144): "weight", (512, 896): "weight"}
    got = sorted((m["op"], tuple(m["shape"]), m["layout"], m["count"]) for m in moves(TPU_MODULE, tracked))
    assert got == [("copy", (512, 896), "{0,1:T(8,128)(2,1)}", 1),
                   ("transpose", (512, 6144), "{0,1:T(8,128)(2,1)}", 1)]
