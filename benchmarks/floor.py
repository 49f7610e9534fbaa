"""How fast a train step's arithmetic could run on this machine, whoever implements it.

A step's matmuls and its optimizer update are work no implementation of the same step can skip.
`step_floor` times each of them alone, with the fastest kernel at hand, and adds the times up:

- Matmuls: every `dot_general` in the step's jaxpr (forward, backward and update; a `scan` body
  counts once per iteration), each distinct product timed alone on hot operands by XLA (jitted,
  the dimension numbers as the step has them) and by torch (`bmm` of contiguous [P, M, K] and
  [P, K, N] operands) on the benchmark's threads, and by torch on one thread at half its time, as
  if two such products ran side by side, one per core. Each library's per-call overhead (a 1x1
  product) is subtracted, and the fastest of the three counts.
- The optimizer: one AdamW update of the step's parameters alone, by XLA (jitted, donated) and
  by torch (`fused=True`), the faster of the two.

Everything else (embeddings, norms, softmax, the loss, copies) counts as free, and nothing overlaps
with anything else, so a real step of the same arithmetic cannot be faster than the floor with
these kernels. A goal below the floor is out of reach on this machine for any implementation
that does not change the arithmetic.

Legend: P batch of a product, M its rows, K its contraction, N its columns.
"""

import collections
import math
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
import torch
from jax import lax

# A timed sample runs a product this long or more (repeated calls), and the fastest of SAMPLES
# samples counts: single calls of small products are below the clock's and the scheduler's noise.
SAMPLE_S, SAMPLES = 2e-3, 5

Product = tuple[tuple[int, ...], tuple[int, ...], tuple]  # (lhs shape, rhs shape, dims)


def dot_generals(jaxpr, repeat: int = 1) -> collections.Counter:
    """Every `dot_general` a jaxpr runs, nested jaxprs included: {(lhs, rhs, dims): count}.

    Raises:
      ValueError: the jaxpr has a `while` loop around a product (its trip count is unknown).
    """
    out = collections.Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            out[(tuple(lhs), tuple(rhs), _dims(eqn.params["dimension_numbers"]))] += repeat
            continue
        times = repeat * eqn.params["length"] if name == "scan" else repeat
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if not hasattr(inner, "eqns"):
                    continue
                found = dot_generals(inner, times)
                if found and name == "while":
                    raise ValueError(
                        f"a while loop runs {sum(found.values())} matmuls an unknown number of "
                        "times; the floor counts straight-line steps and scans only"
                    )
                out.update(found)
    return out


def _dims(dimension_numbers) -> tuple:
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def canonical(product: Product) -> tuple[int, int, int, int]:
    """(P, M, K, N) of a `dot_general`: batch, free lhs, contracted and free rhs sizes."""
    lhs, rhs, ((lc, rc), (lb, rb)) = product
    if [lhs[i] for i in lc] != [rhs[i] for i in rc] or [lhs[i] for i in lb] != [rhs[i] for i in rb]:
        raise ValueError(f"dot_general of {lhs} and {rhs}: dimension numbers {product[2]} differ")
    free = lambda shape, used: math.prod(s for i, s in enumerate(shape) if i not in used)
    return (
        math.prod(lhs[i] for i in lb),
        free(lhs, lc + lb),
        math.prod(lhs[i] for i in lc),
        free(rhs, rc + rb),
    )


def flops(product: Product) -> int:
    p, m, k, n = canonical(product)
    return 2 * p * m * k * n


def _fastest(fn: Callable[[], object]) -> float:
    """Seconds per call of `fn` on a warm machine: the fastest of SAMPLES repeated-call samples."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, min(10_000, math.ceil(SAMPLE_S / max(time.perf_counter() - t0, 1e-7))))
    best = math.inf
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _xla_time(product: Product) -> float:
    lhs, rhs, dims = product
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.standard_normal(lhs, np.float32))
    y = jax.numpy.asarray(rng.standard_normal(rhs, np.float32))
    fn = jax.jit(lambda a, b: lax.dot_general(a, b, dims))
    return _fastest(lambda: fn(x, y).block_until_ready())


def _torch_time(p: int, m: int, k: int, n: int, threads: int) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, y, out = torch.randn(p, m, k), torch.randn(p, k, n), torch.empty(p, m, n)
        return _fastest(lambda: torch.bmm(x, y, out=out))
    finally:
        torch.set_num_threads(previous)


def matmul_floor(products: collections.Counter) -> dict:
    """Summed fastest standalone times of `products` ({product: count}).

    Returns:
      {"ms", "xla_ms" (XLA's kernels only), "gflop", "gflop_s" (at the floor), "products",
      "distinct", "by_product": every distinct product as [count, [P, M, K, N], ms at the floor,
      XLA's ms, torch's ms] (all counts included), costliest first}.
    """
    threads = torch.get_num_threads()
    one = ((1, 1), (1, 1), (((1,), (0,)), ((), ())))
    xla_overhead = _xla_time(one)
    torch_overhead = _torch_time(1, 1, 1, 1, threads)
    total = xla_total = 0.0
    rows = []
    for product, count in products.items():
        shape = canonical(product)
        xla = max(0.0, _xla_time(product) - xla_overhead)
        ref = max(0.0, _torch_time(*shape, threads) - torch_overhead)
        if threads > 1:
            ref = min(ref, max(0.0, _torch_time(*shape, 1) - torch_overhead) / threads)
        total += count * min(xla, ref)
        xla_total += count * xla
        rows.append([count, list(shape), *(1e3 * count * t for t in (min(xla, ref), xla, ref))])
    gflop = sum(count * flops(p) for p, count in products.items()) / 1e9
    return {
        "ms": 1e3 * total,
        "xla_ms": 1e3 * xla_total,
        "gflop": gflop,
        "gflop_s": gflop / total if total else math.inf,
        "products": sum(products.values()),
        "distinct": len(products),
        "by_product": sorted(rows, key=lambda r: -r[2]),
    }


def adamw_floor(params, lr: float, betas: tuple, eps: float, weight_decay: float) -> dict:
    """One AdamW update of `params` alone: XLA (jitted, donated) and torch (fused), in ms."""
    tx = optax.adamw(lr, *betas, eps=eps, weight_decay=weight_decay)
    grads = jax.tree.map(lambda x: jax.numpy.full_like(x, 1e-3), params)

    def update(params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update = jax.jit(update, donate_argnums=(0, 1))
    state = [jax.tree.map(jax.numpy.array, params)]  # copies: the update donates them
    state.append(tx.init(state[0]))

    def xla():
        state[0], state[1] = update(*state)
        jax.block_until_ready(state[0])

    tensors = [torch.from_numpy(np.array(x)).requires_grad_() for x in jax.tree.leaves(params)]
    for t in tensors:
        t.grad = torch.full_like(t, 1e-3)
    opt = torch.optim.AdamW(
        tensors, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True
    )
    out = {"xla_ms": 1e3 * _fastest(xla), "torch_ms": 1e3 * _fastest(opt.step)}
    out["ms"] = min(out["xla_ms"], out["torch_ms"])
    return out


def step_floor(step_fn: Callable, args: tuple, params, adamw: dict) -> dict:
    """The floor of one call of `step_fn(*args)`: its matmuls plus an AdamW update of `params`.

    Args:
      step_fn: the whole train step (forward, backward, update), traceable.
      args: its arguments (arrays or abstract values of the step's shapes).
      params: the parameters AdamW updates.
      adamw: AdamW's hyperparameters (`lr`, `betas`, `eps`, `weight_decay`).

    Returns:
      {"ms": matmuls + AdamW, "matmuls": `matmul_floor`, "adamw": `adamw_floor`}.
    """
    products = dot_generals(jax.make_jaxpr(step_fn)(*args).jaxpr)
    matmuls = matmul_floor(products)
    update = adamw_floor(params, **adamw)
    return {"ms": matmuls["ms"] + update["ms"], "matmuls": matmuls, "adamw": update}
