"""What a rematerialised layer keeps for its backward pass: the `remat_policy` of every tower.

With `remat=True` each transformer layer (BERT, the BART encoder and decoder, the Llama decoder)
runs under `jax.checkpoint`: the backward pass recomputes from the layer's input whatever the
policy did not save. The policies:

- "full": nothing inside the layer is saved; its whole forward pass runs again in the backward
  pass (the behaviour of `remat=True` before policies existed, and the default).
- "attention": the query, key and value projections' outputs and the attention core's output
  (under the splash kernel, `models.splash`, the kernel's own residuals: its padded output and
  [h, T] log-sum-exp, so its forward pass does not run again). The output projection and the
  feed-forward layer are recomputed; the XLA path recomputes its scores from the saved queries
  and keys, and the flash kernel reruns its forward pass for its softmax statistics, which it
  does not expose to a policy.
- "projections": the outputs of every projection but the feed-forward's hidden one: query, key,
  value, the attention's output projection and the feed-forward's last matrix (BART `wo`, Llama
  `down_proj`). Recomputed: the attention core (the XLA path's scores and mixing, or a kernel's
  forward pass) and the feed-forward's hidden [.., F] activations (BART `wi`, Llama `gate_proj`
  and `up_proj`: the widest arrays of a layer), by one matmul from the saved values.
- "attention_and_projections": both: recomputed, the feed-forward's hidden activations (and
  what "attention" recomputes of the attention core: the XLA path's scores, the flash kernel's
  forward pass; nothing of the splash kernel's).
- "dots": every matmul output without batch dimensions (`jax.checkpoint_policies.
  dots_with_no_batch_dims_saveable`): all projections, the feed-forward's hidden activations
  included. Recomputed: the attention core and the elementwise work.

The names below mark those arrays (`jax.ad_checkpoint.checkpoint_name`) in the [.., H] layout
of the projections, not split into heads: on a TPU a head axis of width 64 would be padded to
128 lanes in memory. Outside `jax.checkpoint` a name is the identity, so a model without remat,
or with "full", computes exactly what it did.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

POLICIES = ("full", "attention", "projections", "attention_and_projections", "dots")

# Checkpoint names of the arrays the names-based policies save.
QUERY = "attention_query"  # the query projection's output
KEY = "attention_key"
VALUE = "attention_value"
ATTENTION = "attention_output"  # the core's output (splash: its output and log-sum-exp)
ATTENTION_PROJECTION = "attention_projection"  # the output projection's output
FFN_OUTPUT = "ffn_output"  # the feed-forward's last matrix's output

_SAVED = {
    "attention": (QUERY, KEY, VALUE, ATTENTION),
    "projections": (QUERY, KEY, VALUE, ATTENTION_PROJECTION, FFN_OUTPUT),
    "attention_and_projections": (
        QUERY,
        KEY,
        VALUE,
        ATTENTION,
        ATTENTION_PROJECTION,
        FFN_OUTPUT,
    ),  # fmt: skip
}


def check_policy(policy: str, setting: str = "remat_policy") -> None:
    if policy not in POLICIES:
        raise ValueError(f"{setting} must be one of {' | '.join(POLICIES)}, got {policy!r}")


def checkpoint_policy(policy: str):
    """The `jax.checkpoint` policy of `policy` (None for "full": nothing saved)."""
    check_policy(policy)
    if policy == "full":
        return None
    if policy == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.save_only_these_names(*_SAVED[policy])


def name(x: jax.Array, what: str) -> jax.Array:
    """`x` marked as `what` (one of the names above) for the names-based policies."""
    return checkpoint_name(x, what)
