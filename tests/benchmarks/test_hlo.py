"""benchmarks/hlo.py: the sums taken in bf16 and the kernels of a program, read from its HLO text."""
import jax
import jax.numpy as jnp
import pytest

from infjax.benchmarks import hlo

BF16 = jnp.bfloat16


def lowered(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text(dialect="hlo")


def compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.parametrize("text_of", [lowered, compiled], ids=["lowered", "compiled"])
def test_a_bf16_scatter_add_and_a_bf16_sum_are_found_and_float32_ones_are_not(text_of):
    ids = jnp.zeros(64, jnp.int32)

    def scatter(dtype):
        return lambda x: jnp.zeros((4, 8), dtype).at[ids].add(x.astype(dtype))

    def total(dtype):
        return lambda x: jax.lax.reduce_sum_p.bind(x.astype(dtype), axes=(0,))

    x = jnp.ones((64, 8))
    if text_of is lowered:            # as JAX asks: bf16 in both (XLA:CPU may widen them when it compiles)
        assert [s.split()[0] for s in hlo.low_precision_sums(text_of(scatter(BF16), x))] == ["scatter"]
        assert [s.split()[0] for s in hlo.low_precision_sums(text_of(total(BF16), x))] == ["reduce"]
    for dtype in (jnp.float32,):
        assert hlo.low_precision_sums(text_of(scatter(dtype), x)) == []
        assert hlo.low_precision_sums(text_of(total(dtype), x)) == []
    # a maximum or a logical and in bf16 is exact: not a sum
    assert hlo.low_precision_sums(text_of(lambda x: jnp.max(x.astype(BF16), axis=0), x)) == []
    assert hlo.low_precision_sums(text_of(lambda x: jnp.all(x > 0, axis=0), x)) == []


# Optimized HLO as XLA prints it for a GPU: a bf16 reduction inside a fusion, a float32 one, XLA:CPU's form of a
# bf16 reducer (a float32 add rounded back to bf16), a scatter, a bf16 "reduction" over an axis of size 1 (XLA:TPU
# writes a reshape so: it adds nothing), and a loop of 12 trips around 2 kernels.
OPTIMIZED = """HloModule jit_step, entry_computation_layout={(bf16[64,768]{1,0})->f32[768]{0}}

%region_add.1 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %add.1 = bf16[] add(%a, %b)
}

%region_add.2 (c: f32[], d: f32[]) -> f32[] {
  %c = f32[] parameter(0)
  %d = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%c, %d)
}

%region_widened.3 (e: bf16[], f: bf16[]) -> bf16[] {
  %e = bf16[] parameter(0)
  %f = bf16[] parameter(1)
  %ce = f32[] convert(%e)
  %cf = f32[] convert(%f)
  %sum = f32[] add(%ce, %cf)
  ROOT %back = bf16[] convert(%sum)
}

%region_max.4 (g: bf16[], h: bf16[]) -> bf16[] {
  %g = bf16[] parameter(0)
  %h = bf16[] parameter(1)
  ROOT %m = bf16[] maximum(%g, %h)
}

%fused_add_reduce.6 (param_0: bf16[64,768]) -> bf16[768] {
  %param_0 = bf16[64,768]{1,0} parameter(0)
  %constant_0 = bf16[] constant(0)
  ROOT %reduce.186.1 = bf16[768]{0} reduce(%param_0, %constant_0), dimensions={0}, to_apply=%region_add.1
}

%fused_reduce.7 (param_0.1: bf16[64,768]) -> f32[768] {
  %param_0.1 = bf16[64,768]{1,0} parameter(0)
  %convert.1 = f32[64,768]{1,0} convert(%param_0.1)
  %constant_1 = f32[] constant(0)
  ROOT %reduce.7 = f32[768]{0} reduce(%convert.1, %constant_1), dimensions={0}, to_apply=%region_add.2
}

%body.8 (p: (s32[], bf16[64,768])) -> (s32[], bf16[64,768]) {
  %p = (s32[], bf16[64,768]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,768]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = bf16[64,768]{1,0} fusion(%x), kind=kLoop, calls=%fused_add_reduce.6
  ROOT %t = (s32[], bf16[64,768]{1,0}) tuple(%next, %y)
}

%cond.9 (q: (s32[], bf16[64,768])) -> pred[] {
  %q = (s32[], bf16[64,768]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main.10 (x.1: bf16[64,768]) -> f32[768] {
  %x.1 = bf16[64,768]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,768]{1,0}) tuple(%zero, %x.1)
  %loop = (s32[], bf16[64,768]{1,0}) while(%init), condition=%cond.9, body=%body.8, backend_config={"known_trip_count":{"n":"12"}}
  %out = bf16[64,768]{1,0} get-tuple-element(%loop), index=1
  %w = bf16[768]{0} reduce(%out, %zero_bf), dimensions={0}, to_apply=%region_widened.3
  %mx = bf16[768]{0} reduce(%out, %zero_bf), dimensions={0}, to_apply=%region_max.4
  %s = bf16[4,768]{1,0} scatter(%out, %idx, %out), update_window_dims={1}, to_apply=%region_add.1
  %one = bf16[1,768]{1,0} slice(%out), slice={[0:1], [0:768]}
  %r1 = bf16[768]{0} reduce(%one, %zero_bf), dimensions={0}, to_apply=%region_add.1
  ROOT %r = f32[768]{0} fusion(%out), kind=kInput, calls=%fused_reduce.7
}
"""


def test_the_sums_of_an_optimized_program_by_their_accumulation_type():
    sums = hlo.low_precision_sums(OPTIMIZED)
    assert sums == ["reduce bf16[768]{0} (reduce.186.1 in fused_add_reduce.6)",
                    "reduce bf16[768]{0} (w in main.10)", "scatter bf16[4,768]{1,0} (s in main.10)"]


def test_kernels_of_an_optimized_program_count_a_loop_body_once_per_trip():
    # entry: the while is control flow (none), reduce w, reduce mx, scatter s, slice one, reduce r1, fusion r -> 6;
    # body: add (the counter), fusion y -> 2 kernels, 12 trips; cond: compare -> 1 kernel, 12 trips
    assert hlo.kernel_counts(OPTIMIZED) == {"kernels": 6 + 2 + 1, "launches": 6 + 12 * (2 + 1)}


def test_a_scan_of_twice_the_length_launches_its_body_twice_as_often():
    """An invariance on a real compiled program: the same kernels, and the extra launches are the body's."""
    def scan(length):
        def f(x):
            return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2.0 + jnp.cos(c), None), x, None, length=length)[0]
        return hlo.kernel_counts(compiled(f, jnp.ones(8)))

    five, ten = scan(5), scan(10)
    assert five["kernels"] == ten["kernels"] > 0
    per_trip = (ten["launches"] - five["launches"]) / 5
    assert per_trip >= 1 and five["launches"] == five["kernels"] + 4 * per_trip


def test_matmul_flops_count_every_dot_of_a_loop_body_once_per_trip():
    """A scan of 5 [64, 32] x [32, 32] products then one more, compiled: 6 products of 2 * 64 * 32 * 32 FLOPs
    (XLA's own cost analysis counts the loop body once), and its gradient: the products of the backward pass too
    (w's gradient in each trip, c's in each trip but the first, whose input x is not differentiated)."""
    def f(x, w):
        y, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
        return (y @ w[0].T).sum()

    x, w = jnp.ones((64, 32)), jnp.ones((5, 32, 32))
    product = 2 * 64 * 32 * 32
    assert hlo.matmul_flops(compiled(f, x, w)) == 6 * product
    backward = 5 + 4 + 2     # dw every trip, dc in 4 of 5 (the loop may compute x's too, unused); dy and dw0
    grad = jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile().as_text()
    assert hlo.matmul_flops(grad) in ((6 + backward) * product, (6 + backward + 1) * product)


def test_matmul_flops_of_a_convolution_are_its_outputs_times_its_window():
    x, k = jnp.ones((2, 16, 16, 3)), jnp.ones((3, 3, 3, 8))
    conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",                    # noqa: E731
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert hlo.matmul_flops(compiled(conv, x, k)) == 2 * (2 * 16 * 16 * 8) * (3 * 3 * 3)
