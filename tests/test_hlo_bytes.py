"""jaxserve.hlo_bytes on hand-written HLO text: what moves and what does not (in-place updates, slices, bitcasts,
tuples), Pallas custom calls and matmuls kept apart from the rest, weight reads split out, while loops counted by
their trip count."""
from __future__ import annotations

from jaxserve.hlo_bytes import parse, parse_instr, totals, traffic

F32 = 4
POOL = 4 * 1024 * F32  # f32[4,1024]
ROW = 1024 * F32  # f32[1,1024]

MODULE = """HloModule m, input_output_alias={ {0}: (0, {}, may-alias) }

%fused_dus (param_0: f32[4,1024], param_1: f32[1,1024], param_2: s32[]) -> f32[4,1024] {
  %param_0 = f32[4,1024]{1,0} parameter(0)
  %param_1 = f32[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = f32[4,1024]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %c)
}

%fused_slice (param_0.1: f32[4,1024]) -> f32[1,1024] {
  %param_0.1 = f32[4,1024]{1,0} parameter(0)
  ROOT %s = f32[1,1024]{1,0} slice(%param_0.1), slice={[0:1], [0:1024]}
}

%fused_add (p0: f32[1,1024], p1: f32[1,1024]) -> f32[1,1024] {
  %p0 = f32[1,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  ROOT %add = f32[1,1024]{1,0} add(%p0, %p1)
}

%gemm (a: f32[1,1024], b: f32[1024,256]) -> f32[1,256] {
  %a = f32[1,1024]{1,0} parameter(0)
  %b = f32[1024,256]{1,0} parameter(1)
  ROOT %d = f32[1,256]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

ENTRY %main (pool: f32[4,1024], x: f32[1,1024], i: s32[], w: f32[1024,256]) -> (f32[4,1024], f32[1,256]) {
  %pool = f32[4,1024]{1,0} parameter(0), metadata={op_name="pages.latent"}
  %x = f32[1,1024]{1,0} parameter(1), metadata={op_name="batch.x"}
  %i = s32[] parameter(2)
  %w = f32[1024,256]{1,0} parameter(3), metadata={op_name="state['layers'][0]['w'].value"}
  %upd = f32[4,1024]{1,0} fusion(%pool, %x, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(f)/scatter"}
  %view = f32[4096]{0} bitcast(%upd)
  %sl = f32[1,1024]{1,0} fusion(%upd), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/slice"}
  %k = (f32[1,1024]{1,0}, f32[8]{0}) custom-call(%sl, %x, /*index=2*/%pool), custom_call_target="__gpu$xla.gpu.triton"
  %g = f32[1,1024]{1,0} get-tuple-element(%k), index=0
  %added = f32[1,1024]{1,0} fusion(%g, %x), kind=kLoop, calls=%fused_add
  %wv = f32[1024,256]{1,0} bitcast(%w)
  %mm = f32[1,256]{1,0} fusion(%added, %wv), kind=kCustom, calls=%gemm
  %cp = f32[4,1024]{1,0} copy(%upd)
  %ar = f32[1,256]{1,0} all-reduce-start(%mm), replica_groups={}, to_apply=%sum
  %ard = f32[1,256]{1,0} all-reduce-done(%ar)
  ROOT %t = (f32[4,1024]{1,0}, f32[1,256]{1,0}) tuple(%upd, %ard)
}
"""


def _by_what(rows):  # noqa: ANN001, ANN202
    return {(r.traffic.category, r.traffic.what or r.traffic.op): r for r in rows}


def test_parse_finds_every_computation_and_the_entry():
    comps, entry = parse(MODULE)
    assert entry == "main"
    assert set(comps) == {"fused_dus", "fused_slice", "fused_add", "gemm", "sum", "main"}
    k = next(i for i in comps["main"] if i.name == "k")
    assert k.op == "custom-call" and k.operands == ("sl", "x", "pool")  # /*index=2*/ comments skipped
    assert k.types == (("f32", (1, 1024)), ("f32", (8,)))  # a tuple-typed result: both arrays
    assert next(i for i in comps["fused_dus"] if i.name == "dus").root


def test_parse_instr_reads_parameter_index_and_scalars():
    ins = parse_instr("  %param.54 = s32[64]{0} parameter(38), sharding={replicated}")
    assert (ins.op, ins.args, ins.types, ins.bytes) == ("parameter", "38", (("s32", (64,)),), 64 * 4)
    assert parse_instr("  %c = u32[] constant(7)").bytes == 4
    assert parse_instr("HloModule m") is None


def test_in_place_update_moves_the_update_not_the_buffer():
    rows = _by_what(traffic(MODULE))
    # reads the row and the index, writes the row into the aliased pool: the pool itself is neither read nor written
    assert rows[("outside", "jit(f)/scatter")].traffic.bytes == ROW + 4 + ROW


def test_slice_reads_only_the_slice():
    assert _by_what(traffic(MODULE))[("outside", "jit(f)/slice")].traffic.bytes == 2 * ROW


def test_free_ops_move_nothing_and_copies_move_everything():
    rows = traffic(MODULE)
    ops = {r.traffic.op for r in rows}
    assert not ops & {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "all-reduce-done"}
    assert _by_what(rows)[("outside", "copy")].traffic.bytes == 2 * POOL


def test_kernels_matmuls_weights_and_collectives_are_apart():
    rows = traffic(MODULE)
    t = totals(rows)
    # the Pallas call: its nominal operands (the whole pool, as passed) + results, never "outside"
    assert t["kernel"] == ROW + ROW + POOL + ROW + 8 * F32
    # the matmul reads its weight through a bitcast: that read is "weights"; the activations stay "matmul"
    assert t["weights"] == 1024 * 256 * F32
    assert t["matmul"] == ROW + 256 * F32
    assert t["collective"] == 256 * F32
    assert t["outside"] == (2 * ROW + 4) + 2 * ROW + 3 * ROW + 2 * POOL  # update, slice, add, copy


WHILE = """HloModule w

%fused_neg (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  ROOT %n = f32[256]{0} negate(%p)
}

%body (arg: (s32[], f32[256])) -> (s32[], f32[256]) {
  %arg = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %v = f32[256]{0} get-tuple-element(%arg), index=1
  %neg = f32[256]{0} fusion(%v), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(f)/neg"}
  ROOT %out = (s32[], f32[256]{0}) tuple(%i, %neg)
}

%cond (arg.1: (s32[], f32[256])) -> pred[] {
  %arg.1 = (s32[], f32[256]{0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: f32[256]) -> (s32[], f32[256]) {
  %x = f32[256]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %x)
  ROOT %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_while_body_counts_its_trip_count():
    rows = traffic(WHILE)
    assert len(rows) == 1
    assert rows[0].count == 5 and rows[0].traffic.bytes == 2 * 256 * F32
    assert totals(rows)["outside"] == 5 * 2 * 256 * F32


GATHER = """HloModule g

%fused_gather (pool: u8[64,576], ids: s32[8,1]) -> f32[8,576] {
  %pool = u8[64,576]{1,0} parameter(0)
  %ids = s32[8,1]{1,0} parameter(1)
  %wide = f32[64,576]{1,0} convert(%pool)
  ROOT %rows = f32[8,576]{1,0} gather(%wide, %ids), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,576}
}

ENTRY %main (pool: u8[64,576], ids: s32[8,1]) -> f32[8,576] {
  %pool = u8[64,576]{1,0} parameter(0)
  %ids = s32[8,1]{1,0} parameter(1)
  ROOT %g = f32[8,576]{1,0} fusion(%pool, %ids), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(f)/gather"}
}
"""


def test_gather_through_an_elementwise_op_reads_only_the_gathered_rows():
    """A loop fusion computes its elementwise ops only where its output needs them: converting the pool and then
    gathering 8 of its 64 rows reads those 8 rows (in the pool's own dtype), and writes them widened."""
    (row,) = traffic(GATHER)
    assert row.traffic.bytes == 8 * 576 * 1 + 8 * 4 + 8 * 576 * F32


LAYER_ROWS = """HloModule lr

%fused_rows (pool: u8[4,64,576], layer: s32[], ids: s32[8,1]) -> f32[8,576] {
  %pool = u8[4,64,576]{2,1,0} parameter(0)
  %layer = s32[] parameter(1)
  %ids = s32[8,1]{1,0} parameter(2)
  %z = s32[] constant(0)
  %one = u8[1,64,576]{2,1,0} dynamic-slice(%pool, %layer, %z, %z), dynamic_slice_sizes={1,64,576}
  %pages = u8[64,576]{1,0} bitcast(%one)
  %wide = f32[64,576]{1,0} convert(%pages)
  ROOT %rows = f32[8,576]{1,0} gather(%wide, %ids), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,576}
}

ENTRY %main (pool: u8[4,64,576], layer: s32[], ids: s32[8,1]) -> f32[8,576] {
  %pool = u8[4,64,576]{2,1,0} parameter(0)
  %layer = s32[] parameter(1)
  %ids = s32[8,1]{1,0} parameter(2)
  ROOT %g = f32[8,576]{1,0} fusion(%pool, %layer, %ids), kind=kLoop, calls=%fused_rows
}
"""


def test_rows_of_one_layer_read_only_those_rows():
    """A layer dynamic-sliced out of the pool and then gathered by row reads the gathered rows, not the layer."""
    (row,) = traffic(LAYER_ROWS)
    assert row.traffic.bytes == 8 * 576 * 1 + 4 + 8 * 4 + 8 * 576 * F32


def test_async_copy_writes_one_copy():
    """copy-start's result is (destination, source, context): the copy reads its operand and writes one copy."""
    text = """HloModule c

ENTRY %main (x: bf16[1024,64]) -> bf16[1024,64] {
  %x = bf16[1024,64]{1,0} parameter(0)
  %cs = (bf16[1024,64]{1,0}, bf16[1024,64]{1,0}, u32[]) copy-start(%x)
  ROOT %cd = bf16[1024,64]{1,0} copy-done(%cs)
}
"""
    (row,) = traffic(text)
    assert row.traffic.op == "copy-start" and row.traffic.bytes == 2 * 1024 * 64 * 2


# XLA:TPU's memory-space assignment (from a v6e compile): weights prefetched into VMEM (S(1)) by copy-start, or by
# slice-start in slices joined there by a ConcatBitcast; an activation prefetched too; the matmul reads VMEM only
TPU_PREFETCH = """HloModule tpu

%fused_mm (p0: bf16[8,1024], p1: bf16[1024,512], p2: s8[512,1024]) -> bf16[8,1024] {
  %p0 = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %p2 = s8[512,1024]{1,0:T(32,128)(4,1)S(1)} parameter(2)
  %h = bf16[8,512]{1,0:T(8,128)(2,1)S(1)} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %w = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} convert(%p2)
  ROOT %o = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_out (q: bf16[8,1024]) -> bf16[8,1024] {
  %q = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %n = bf16[8,1024]{1,0:T(8,128)(2,1)} negate(%q)
}

ENTRY %main (x: bf16[8,1024], w1: bf16[1024,512], w2: s8[512,1024]) -> bf16[8,1024] {
  %x = bf16[8,1024]{1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="batch.x"}
  %w1 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(1), metadata={op_name="state['w1'].value"}
  %w2 = s8[512,1024]{1,0:T(32,128)(4,1)} parameter(2), metadata={op_name="state['w2'].value"}
  %flat = s8[524288]{0:T(1024)(128)(4,1)} bitcast(%w2)
  %cs = (bf16[1024,512]{1,0:T(8,128)(2,1)S(1)}, bf16[1024,512]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w1), cross_program_prefetch_index=0
  %cx = (bf16[8,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[8,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%x)
  %ss = ((s8[524288]{0:T(1024)(128)(4,1)}), s8[262144]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%flat), slice={[0:262144]}
  %ss.1 = ((s8[524288]{0:T(1024)(128)(4,1)}), s8[262144]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%flat), slice={[262144:524288]}
  %cd = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %cdx = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} copy-done(%cx)
  %sd = s8[262144]{0:T(1024)(128)(4,1)S(1)} slice-done(%ss)
  %sd.1 = s8[262144]{0:T(1024)(128)(4,1)S(1)} slice-done(%ss.1)
  %cat = s8[512,1024]{1,0:T(32,128)(4,1)S(1)} custom-call(%sd, %sd.1), custom_call_target="ConcatBitcast"
  %mm = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} fusion(%cdx, %cd, %cat), kind=kOutput, calls=%fused_mm
  ROOT %out = bf16[8,1024]{1,0:T(8,128)(2,1)} fusion(%mm), kind=kLoop, calls=%fused_out, metadata={op_name="jit(f)/neg"}
}
"""
X, W1, W2 = 8 * 1024 * 2, 1024 * 512 * 2, 512 * 1024


def test_memory_spaces_are_parsed_per_array():
    ins = parse_instr("  %ss = ((s8[64]{0:T(1024)(128)(4,1)}), s8[32]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) "
                      "slice-start(%flat), slice={[0:32]}")
    assert ins.spaces == (0, 1, 2) and ins.bytes == 64 + 32 + 4 and ins.hbm_bytes == 64
    assert parse_instr("  %c = f32[4,8]{1,0} copy(%x)").hbm_bytes == 4 * 8 * F32  # GPU / CPU layouts: HBM


def test_tpu_weight_prefetches_are_the_weights_read_once():
    """copy-start of a weight into VMEM reads it once from HBM, writes nothing to HBM: that read is the weight's
    ("weights", as the minimum counts it); each slice-start reads its slice (not the whole source); the slices'
    ConcatBitcast in VMEM moves nothing."""
    rows = traffic(TPU_PREFETCH)
    t = totals(rows)
    assert t["weights"] == W1 + W2  # each weight once: copy-start W1, two slice-starts W2 / 2 each
    by = {(r.traffic.category, r.traffic.op): r for r in rows}
    assert by[("weights", "slice-start")].count == 2 and by[("weights", "slice-start")].traffic.bytes == W2 // 2
    assert by[("weights", "copy-start")].traffic.bytes == W1
    # no weight prefetch is left "outside"; the ConcatBitcast in VMEM moves nothing
    assert ("outside", "slice-start") not in by
    assert by[("outside", "custom-call:ConcatBitcast")].traffic.bytes == 0


def test_consumers_of_vmem_buffers_move_no_hbm_bytes():
    """The activation's prefetch reads it from HBM once (outside); the matmul reading it and the weights from VMEM
    and writing VMEM moves nothing; the last fusion reads VMEM and writes its HBM result."""
    rows = traffic(TPU_PREFETCH)
    t = totals(rows)
    assert t["matmul"] == 0
    assert t["outside"] == X + X  # the activation's copy-start (read) + the negate's HBM result (write)
    by = {(r.traffic.category, r.traffic.op): r.traffic.bytes for r in rows}
    assert by[("outside", "copy-start")] == X and by[("outside", "fusion:kLoop")] == X


def test_a_prefetch_a_kernel_reads_is_outside():
    """XLA:TPU prefetching a Pallas kernel's weight operand (an expert stack, sliced into VMEM and joined there) moves
    the whole operand outside the kernel, which would read only the experts a batch routes to: "outside", not the
    weights' read."""
    text = """HloModule k

ENTRY %main (x: bf16[8,512], e: s8[4,512,256]) -> bf16[8,256] {
  %x = bf16[8,512]{1,0:T(8,128)(2,1)} parameter(0)
  %e = s8[4,512,256]{2,1,0:T(32,128)(4,1)} parameter(1), metadata={op_name="state['experts'].value"}
  %flat = s8[524288]{0:T(1024)(128)(4,1)} bitcast(%e)
  %ss = ((s8[524288]{0:T(1024)(128)(4,1)}), s8[262144]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%flat), slice={[0:262144]}
  %ss.1 = ((s8[524288]{0:T(1024)(128)(4,1)}), s8[262144]{0:T(1024)(128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%flat), slice={[262144:524288]}
  %sd = s8[262144]{0:T(1024)(128)(4,1)S(1)} slice-done(%ss)
  %sd.1 = s8[262144]{0:T(1024)(128)(4,1)S(1)} slice-done(%ss.1)
  %cat = s8[4,512,256]{2,1,0:T(32,128)(4,1)S(1)} custom-call(%sd, %sd.1), custom_call_target="ConcatBitcast"
  ROOT %k = bf16[8,256]{1,0:T(8,128)(2,1)} custom-call(%x, %cat), custom_call_target="tpu_custom_call"
}
"""
    t = totals(traffic(text))
    assert t["weights"] == 0 and t["outside"] == 4 * 512 * 256  # the stack read once, in its two slices
    assert t["kernel"] == 8 * 512 * 2 + 8 * 256 * 2  # x from HBM, the stack from VMEM (none), its result


def test_a_fusion_writing_vmem_reads_only_its_slices():
    """A fusion whose result lives in VMEM still reads only what it slices of an HBM operand (one embedding row,
    not the table)."""
    text = """HloModule e

%fused_row (t: bf16[64,128], i: s32[]) -> bf16[1,1,128] {
  %t = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[]{:T(128)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  %r = bf16[1,128]{1,0:T(2,128)(2,1)} dynamic-slice(%t, %i, %z), dynamic_slice_sizes={1,128}
  ROOT %b = bf16[1,1,128]{2,1,0:T(2,128)(2,1)S(1)} bitcast(%r)
}

ENTRY %main (t: bf16[64,128], i: s32[]) -> bf16[1,1,128] {
  %t = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="state['embed'].value"}
  %i = s32[]{:T(128)} parameter(1)
  ROOT %f = bf16[1,1,128]{2,1,0:T(2,128)(2,1)S(1)} fusion(%t, %i), kind=kLoop, calls=%fused_row
}
"""
    t = totals(traffic(text))
    assert t["weights"] == 128 * 2 and t["outside"] == 4  # the row and the index read; nothing written to HBM


def test_a_prefetch_of_the_whole_embedding_is_outside():
    """The minimum counts the batch's rows of the embedding, not the table: XLA:TPU prefetching the whole shard into
    VMEM (to gather a few rows there) moves it outside the weights' read."""
    text = """HloModule emb

ENTRY %main (t: bf16[64,128]) -> bf16[64,128] {
  %t = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="state[\\'embed\\'].value"}
  %cs = (bf16[64,128]{1,0:T(8,128)(2,1)S(1)}, bf16[64,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%t), cross_program_prefetch_index=0
  ROOT %cd = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
}
"""
    t = totals(traffic(text))
    assert t["weights"] == 0 and t["outside"] == 64 * 128 * 2
