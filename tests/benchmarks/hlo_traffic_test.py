"""`benchmarks.hlo`'s split of the traffic outside the differentiated function ("optimizer and
the rest") by what the instructions do, on a hand-written program with one instruction of each
kind an optimised train step has there; what prefetching slices and a fusion that slices its
operand read."""

from benchmarks import hlo

N = 256 * 128  # elements of each parameter-shaped array
F32, BF16 = 4 * N, 2 * N

PROGRAM = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_cast (c0: f32[256,128]) -> bf16[256,128] {
  %c0 = f32[256,128]{1,0} parameter(0)
  ROOT %c = bf16[256,128]{1,0} convert(%c0)
}

%fused_dot (d0: bf16[256,128], d1: bf16[128,128]) -> bf16[256,128] {
  %d0 = bf16[256,128]{1,0} parameter(0)
  %d1 = bf16[128,128]{1,0:S(1)} parameter(1)
  ROOT %d = bf16[256,128]{1,0} dot(%d0, %d1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_norm (n0: bf16[256,128]) -> f32[] {
  %n0 = bf16[256,128]{1,0} parameter(0)
  %n1 = f32[256,128]{1,0} convert(%n0)
  %n2 = f32[256,128]{1,0} multiply(%n1, %n1)
  %zero = f32[] constant(0)
  ROOT %n3 = f32[] reduce(%n2, %zero), dimensions={0,1}, to_apply=%add
}

%fused_adam (p: f32[256,128], g: bf16[256,128], m: f32[256,128], v: f32[256,128], lr: f32[]) -> (f32[256,128], f32[256,128], f32[256,128]) {
  %p = f32[256,128]{1,0} parameter(0)
  %g = bf16[256,128]{1,0} parameter(1)
  %m = f32[256,128]{1,0} parameter(2)
  %v = f32[256,128]{1,0} parameter(3)
  %lr = f32[] parameter(4)
  %gf = f32[256,128]{1,0} convert(%g)
  %m2 = f32[256,128]{1,0} add(%m, %gf)
  %g2 = f32[256,128]{1,0} multiply(%gf, %gf)
  %v2 = f32[256,128]{1,0} add(%v, %g2)
  %r = f32[256,128]{1,0} sqrt(%v2)
  %u = f32[256,128]{1,0} divide(%m2, %r)
  %b = f32[256,128]{1,0} broadcast(%lr), dimensions={}
  %s = f32[256,128]{1,0} multiply(%u, %b)
  %p2 = f32[256,128]{1,0} subtract(%p, %s)
  ROOT %t = (f32[256,128]{1,0}, f32[256,128]{1,0}, f32[256,128]{1,0}) tuple(%p2, %m2, %v2)
}

%fused_transpose (t0: f32[256,128]) -> f32[128,256] {
  %t0 = f32[256,128]{1,0} parameter(0)
  ROOT %tt = f32[128,256]{1,0} transpose(%t0), dimensions={1,0}
}

ENTRY %main (p: f32[256,128], m: f32[256,128], v: f32[256,128], w: bf16[128,128], step: f32[]) -> (f32[256,128], f32[256,128], f32[256,128], f32[128,256], f32[]) {
  %p = f32[256,128]{1,0} parameter(0)
  %m = f32[256,128]{1,0} parameter(1)
  %v = f32[256,128]{1,0} parameter(2)
  %w = bf16[128,128]{1,0} parameter(3)
  %step = f32[] parameter(4)
  %pb = bf16[256,128]{1,0} fusion(%p), kind=kLoop, calls=%fused_cast, metadata={op_name="jit(step)/convert_element_type"}
  %h = bf16[256,128]{1,0} fusion(%pb, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/transpose(jvp(Bart))/Bart.encode/encoder/layer_0/mlp/fc1/dot_general"}
  %g = bf16[256,128]{1,0} all-reduce(%h), replica_groups={}, to_apply=%add, metadata={op_name="jit(step)/psum"}
  %norm = f32[] fusion(%g), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/reduce_sum"}
  %lr = f32[] multiply(%step, %norm), metadata={op_name="jit(step)/mul"}
  %new = (f32[256,128]{1,0}, f32[256,128]{1,0}, f32[256,128]{1,0}) fusion(%p, %g, %m, %v, %lr), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/add"}
  %p2 = f32[256,128]{1,0} get-tuple-element(%new), index=0
  %m2 = f32[256,128]{1,0} get-tuple-element(%new), index=1
  %v2 = f32[256,128]{1,0} get-tuple-element(%new), index=2
  %pt = f32[128,256]{1,0} fusion(%p2), kind=kLoop, calls=%fused_transpose, metadata={op_name="jit(step)/transpose"}
  %pc = f32[256,128]{1,0} copy(%p2), metadata={op_name="state.params"}
  ROOT %out = (f32[256,128]{1,0}, f32[256,128]{1,0}, f32[256,128]{1,0}, f32[128,256]{1,0}, f32[]) tuple(%pc, %m2, %v2, %pt, %lr)
}
"""  # noqa: E501


def test_the_rest_is_split_by_what_each_instruction_does():
    got = hlo.traffic(PROGRAM)
    expected = {
        "casts": F32 + BF16,  # the float32 parameter read, its bfloat16 copy written
        "collectives": BF16 + BF16,  # the gradient's sum (its own op name: outside the model)
        "gradient norms": BF16 + 4,  # every gradient read for one scalar
        "other": 4 + 4 + 4,  # the learning rate from the step and the norm
        # parameter, gradient, both moments and the learning rate in; parameter, moments out
        "optimizer update": (F32 + BF16 + F32 + F32 + 4) + 3 * F32,
        "copies and layout changes": (F32 + F32) + (F32 + F32),  # the transpose and the copy
    }
    assert got.outside_by_kind == expected
    assert set(expected) == set(hlo.OUTSIDE_PARTS)
    # The split is of "optimizer and the rest" alone: the backward's matmul stays in its part.
    assert got.by_part["optimizer and the rest"] == sum(expected.values())
    assert got.by_part["feed-forward"] == BF16 + 2 * 128 * 128 + BF16
    assert got.hbm_bytes == got.by_part["optimizer and the rest"] + got.by_part["feed-forward"]


def test_a_multi_output_fusion_with_a_square_root_is_the_update_whatever_its_op_name():
    # JAX names the fused update after its last primitive; a name that says "mul" or "sqrt"
    # does not change what it is.
    renamed = PROGRAM.replace('calls=%fused_adam, metadata={op_name="jit(step)/add"}',
                              'calls=%fused_adam, metadata={op_name="jit(step)/mul"}')  # fmt: skip
    assert hlo.traffic(renamed).outside_by_kind == hlo.traffic(PROGRAM).outside_by_kind


def test_an_elementwise_fusion_that_keeps_its_dtype_is_not_a_cast():
    program = PROGRAM.replace(
        "ROOT %c = bf16[256,128]{1,0} convert(%c0)", "ROOT %c = f32[256,128]{1,0} negate(%c0)"
    ).replace("%pb = bf16[256,128]{1,0} fusion(%p)", "%pb = f32[256,128]{1,0} fusion(%p)")
    got = hlo.traffic(program).outside_by_kind
    assert "casts" not in got and got["other"] == 12 + F32 + F32


SLICED = """HloModule m, is_scheduled=true

%fused_adam (p: f32[1024,128], g: f32[1024,128]) -> f32[1024,128] {
  %p = f32[1024,128]{1,0:S(1)} parameter(0)
  %g = f32[1024,128]{1,0} parameter(1)
  %r = f32[1024,128]{1,0} sqrt(%g)
  ROOT %n = f32[1024,128]{1,0} subtract(%p, %r)
}

%fused_attn (x: bf16[256,128], w: bf16[128,128]) -> bf16[256,128] {
  %x = bf16[256,128]{1,0} parameter(0)
  %w = bf16[128,128]{1,0:S(1)} parameter(1)
  ROOT %d = bf16[256,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p: f32[1024,128], g: f32[1024,128], x: bf16[256,128], w: bf16[128,128]) -> (f32[1024,128], bf16[256,128]) {
  %p = f32[1024,128]{1,0} parameter(0)
  %g = f32[1024,128]{1,0} parameter(1)
  %x = bf16[256,128]{1,0} parameter(2)
  %w = bf16[128,128]{1,0} parameter(3)
  %s0 = ((f32[1024,128]{1,0}), f32[256,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:256], [0:128]}
  %s1 = ((f32[1024,128]{1,0}), f32[256,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[256:512], [0:128]}
  %s2 = ((f32[1024,128]{1,0}), f32[256,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[512:768], [0:128]}
  %s3 = ((f32[1024,128]{1,0}), f32[256,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[768:1024], [0:128]}
  %d0 = f32[256,128]{1,0:S(1)} slice-done(%s0)
  %d1 = f32[256,128]{1,0:S(1)} slice-done(%s1)
  %d2 = f32[256,128]{1,0:S(1)} slice-done(%s2)
  %d3 = f32[256,128]{1,0:S(1)} slice-done(%s3)
  %pv = f32[1024,128]{1,0:S(1)} custom-call(%d0, %d1, %d2, %d3), custom_call_target="ConcatBitcast"
  %new = f32[1024,128]{1,0} fusion(%pv, %g), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/add"}
  %cs = (bf16[128,128]{1,0:S(1)}, bf16[128,128]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[128,128]{1,0:S(1)} copy-done(%cs)
  %h = bf16[256,128]{1,0} fusion(%x, %cd), kind=kOutput, calls=%fused_attn, metadata={op_name="jit(step)/jvp(Bart)/encoder/layer_0/self_attn/query/dot_general"}
  ROOT %out = (f32[1024,128]{1,0}, bf16[256,128]{1,0}) tuple(%new, %h)
}
"""  # noqa: E501


def test_a_prefetch_counts_its_slices_once_and_with_the_instruction_it_serves():
    got = hlo.traffic(SLICED)
    param = 1024 * 128 * 4
    # Four slices of a quarter each read the parameter once (not four times), into on-chip
    # memory; the update then reads the gradient and writes the new parameter.
    assert got.outside_by_kind == {"optimizer update": param + (param + param)}
    # The weight copied into on-chip memory for the query projection is the attention's read.
    w, x = 128 * 128 * 2, 256 * 128 * 2
    assert got.by_part == {"optimizer and the rest": 3 * param, "attention": w + x + x}
    assert got.hbm_bytes == 3 * param + w + 2 * x


BLOCKWISE = """HloModule m, is_scheduled=true

%slice_dot (q: bf16[8,128], big: bf16[4096,128], i: s32[]) -> f32[8,1024] {
  %q = bf16[8,128]{1,0:S(1)} parameter(0)
  %big = bf16[4096,128]{1,0} parameter(1)
  %i = s32[]{:S(1)} parameter(2)
  %z = s32[]{:S(1)} constant(0)
  %rows = bf16[1024,128]{1,0} dynamic-slice(%big, %i, %z), dynamic_slice_sizes={1024,128}
  ROOT %s = f32[8,1024]{1,0} dot(%q, %rows), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%score_top (q: bf16[8,128], big: bf16[4096,128], i: s32[], whole: bf16[4096,128]) -> f32[8,8] {
  %q = bf16[8,128]{1,0:S(1)} parameter(0)
  %big = bf16[4096,128]{1,0} parameter(1)
  %i = s32[]{:S(1)} parameter(2)
  %whole = bf16[4096,128]{1,0} parameter(3)
  %scores = f32[8,1024]{1,0} fusion(%q, %big, %i), kind=kOutput, calls=%slice_dot
  %neg = bf16[4096,128]{1,0} negate(%whole)
  ROOT %top = f32[8,8]{1,0:S(1)} slice(%scores), slice={[0:8], [0:8]}
}

%body (s: (s32[], bf16[4096,128], bf16[8,128])) -> (s32[], bf16[4096,128], bf16[8,128]) {
  %s = (s32[], bf16[4096,128]{1,0}, bf16[8,128]{1,0:S(1)}) parameter(0)
  %i = s32[]{:S(1)} get-tuple-element(%s), index=0
  %big = bf16[4096,128]{1,0} get-tuple-element(%s), index=1
  %q = bf16[8,128]{1,0:S(1)} get-tuple-element(%s), index=2
  %t = f32[8,8]{1,0:S(1)} fusion(%q, %big, %i, %big), kind=kCustom, calls=%score_top, metadata={op_name="jit(search)/while/body/approx_top_k"}
  ROOT %r = (s32[], bf16[4096,128]{1,0}, bf16[8,128]{1,0:S(1)}) tuple(%i, %big, %q)
}

%cond (s: (s32[], bf16[4096,128], bf16[8,128])) -> pred[] {
  %s = (s32[], bf16[4096,128]{1,0}, bf16[8,128]{1,0:S(1)}) parameter(0)
  ROOT %p = pred[]{:S(1)} constant(true)
}

ENTRY %main (big: bf16[4096,128], q: bf16[8,128]) -> (s32[], bf16[4096,128], bf16[8,128]) {
  %big = bf16[4096,128]{1,0} parameter(0)
  %q = bf16[8,128]{1,0:S(1)} parameter(1)
  %z = s32[]{:S(1)} constant(0)
  %init = (s32[], bf16[4096,128]{1,0}, bf16[8,128]{1,0:S(1)}) tuple(%z, %big, %q)
  ROOT %w = (s32[], bf16[4096,128]{1,0}, bf16[8,128]{1,0:S(1)}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""  # noqa: E501


def test_a_fusion_reads_only_the_blocks_it_slices_of_an_operand():
    """A loop scores a large array block by block: each time its fusion is given the whole array
    and dynamic-slices one block inside a nested fusion, so it reads the block (4 x 1,024 rows:
    the array once over the loop); the same array passed as an operand it reads whole (negates)
    is read whole each time."""
    got = hlo.traffic(BLOCKWISE)
    block, whole = 1024 * 128 * 2, 4096 * 128 * 2
    assert got.loops == [("w", 4)]
    assert got.hbm_bytes == 4 * (block + whole)
