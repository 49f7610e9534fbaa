"""benchmarks/floor.py: which matmuls a step runs, their sizes, and the floor's invariants.

The products are checked against functions whose matmuls are known by construction; sizes and
FLOPs against brute-force counts from the operand shapes. Timings are only checked for what holds
by definition (the floor takes the fastest kernel, so it is never above XLA's alone).
"""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from benchmarks import floor

MATMUL = ((1,), (0,)), ((), ())  # [M, K] x [K, N]


def _zeros(*shape):
    return jnp.zeros(shape, jnp.float32)


def test_dot_generals_finds_nested_products_and_counts_scan_iterations():
    def fn(x, w, a, b):
        h = jnp.tanh(x @ w)  # [3, 5] x [5, 7]
        batched = jnp.einsum("bij,bjk->bik", a, b)  # [2, 4, 6] x [2, 6, 9]

        def body(carry, _):
            return jnp.tanh(carry @ jnp.ones((7, 7))), None  # [3, 7] x [7, 7], 4 times

        h, _ = lax.scan(body, h, None, length=4)
        inner = jax.jit(lambda y, v: y @ v.T)(h, w)  # [3, 7] x [7, 5] inside a pjit
        return h.sum() + batched.sum() + inner.sum()

    found = floor.dot_generals(
        jax.make_jaxpr(fn)(_zeros(3, 5), _zeros(5, 7), _zeros(2, 4, 6), _zeros(2, 6, 9)).jaxpr
    )
    shapes = collections.Counter()
    for (lhs, rhs, _), count in found.items():
        shapes[(lhs, rhs)] += count
    assert shapes == {
        ((3, 5), (5, 7)): 1,
        ((2, 4, 6), (2, 6, 9)): 1,
        ((3, 7), (7, 7)): 4,
        ((3, 7), (7, 5)): 1,
    }


def test_dot_generals_refuses_a_while_loop_around_a_product():
    def fn(x):
        return lax.while_loop(lambda c: c[0, 0] < 10.0, lambda c: c @ c + 1.0, x)

    with pytest.raises(ValueError, match="while loop runs 1 matmuls"):
        floor.dot_generals(jax.make_jaxpr(fn)(_zeros(4, 4)).jaxpr)


def test_a_while_loop_without_products_is_fine():
    def fn(x, w):
        x = lax.while_loop(lambda c: c[0] < 10.0, lambda c: c + 1.0, x)
        return x @ w

    found = floor.dot_generals(jax.make_jaxpr(fn)(_zeros(3), _zeros(3, 2)).jaxpr)
    assert sum(found.values()) == 1


@pytest.mark.parametrize(
    "lhs, rhs, dims",
    [
        ((3, 5), (5, 7), MATMUL),
        ((5, 3), (5, 7), (((0,), (0,)), ((), ()))),  # a weight gradient: x^T dy
        ((2, 4, 3, 6), (2, 3, 6, 9), (((3,), (2,)), ((0, 2), (0, 1)))),  # heads in the middle
        ((2, 11, 3, 4), (3, 4, 5), (((2, 3), (0, 1)), ((), ()))),  # two contracted axes
    ],
)
def test_canonical_sizes_and_flops_match_a_brute_force_count(lhs, rhs, dims):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(lhs), rng.standard_normal(rhs)
    out = np.asarray(lax.dot_general(jnp.asarray(x), jnp.asarray(y), dims))
    (lc, _), (lb, _) = dims
    multiply_adds = out.size * math.prod(lhs[i] for i in lc)
    p, m, k, n = floor.canonical((lhs, rhs, dims))
    assert p * m * n == out.size and k == math.prod(lhs[i] for i in lc)
    assert p == math.prod(lhs[i] for i in lb)
    assert floor.flops((lhs, rhs, dims)) == 2 * multiply_adds


def test_canonical_names_both_shapes_when_the_dimensions_disagree():
    with pytest.raises(ValueError, match=r"\(3, 5\) and \(4, 7\)"):
        floor.canonical(((3, 5), (4, 7), MATMUL))


def test_matmul_floor_takes_the_fastest_kernel_per_product_and_counts_repeats():
    products = collections.Counter({((64, 32), (32, 48), MATMUL): 3, ((2, 8, 16), (2, 16, 4),
                                   (((2,), (1,)), ((0,), (0,)))): 2})  # fmt: skip
    result = floor.matmul_floor(products)
    assert result["products"] == 5 and result["distinct"] == 2
    assert result["gflop"] == pytest.approx((3 * 2 * 64 * 32 * 48 + 2 * 2 * 2 * 8 * 16 * 4) / 1e9)
    assert 0 < result["ms"] <= result["xla_ms"]
    rows = result["by_product"]
    assert sorted(row[1] for row in rows) == [[1, 64, 32, 48], [2, 8, 16, 4]]
    assert sum(row[2] for row in rows) == pytest.approx(result["ms"])
    assert sum(row[3] for row in rows) == pytest.approx(result["xla_ms"])
    assert all(row[2] == min(row[3], row[4]) for row in rows)


def test_adamw_floor_times_both_libraries_and_keeps_the_faster():
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
    result = floor.adamw_floor(params, 1e-3, (0.9, 0.999), 1e-8, 0.01)
    assert result["ms"] == min(result["xla_ms"], result["torch_ms"]) > 0
    np.testing.assert_array_equal(params["w"], 1.0)  # the update works on copies


def test_step_floor_adds_the_update_to_the_matmuls():
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    w, x = jnp.ones((16, 8)), jnp.ones((32, 16))
    result = floor.step_floor(step, (w, x), {"w": w}, dict(lr=1e-3, betas=(0.9, 0.999),
                              eps=1e-8, weight_decay=0.0))  # fmt: skip
    assert result["matmuls"]["products"] == 2  # x @ w and its transpose for the gradient
    assert result["ms"] == pytest.approx(result["matmuls"]["ms"] + result["adamw"]["ms"])
