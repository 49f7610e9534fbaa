"""What a rematerialised layer keeps for its backward pass: the `remat_policy` of every tower.

With `remat=True` each transformer layer (BERT, the BART encoder and decoder, the Llama decoder)
runs under `jax.checkpoint`: the backward pass recomputes from the layer's input whatever the
policy did not save. The policies, from least memory to least recomputation:

- "full": nothing inside the layer is saved; its whole forward pass runs again in the backward
  pass (the behaviour of `remat=True` before policies existed, and the default).
- "attention": the attention's queries, keys and values as the attention core reads them and its
  output (the Pallas splash kernel's own residuals: its output and [h, T] log-sum-exp). The
  output projection and the feed-forward layer are recomputed. Under the splash kernel
  (`models.splash`) this spares the kernel's forward pass in the backward one; the XLA path
  recomputes its scores from the saved queries and keys, and the flash kernel reruns its forward
  pass for its softmax statistics, which it does not expose to a policy.
- "all_but_ffn_hidden": "attention" and the outputs of the attention's output projection and of
  the feed-forward's last matrix (BART `wo`, Llama `down_proj`): only the feed-forward's hidden
  [.., F] activations (BART `wi`, Llama `gate_proj` and `up_proj`, the widest arrays of a layer)
  are recomputed, by one matmul from the saved values.
- "dots": every matmul output without batch dimensions (`jax.checkpoint_policies.
  dots_with_no_batch_dims_saveable`): all projections, feed-forward hidden activations
  included. The attention core (the XLA path's batched score and mixing matmuls, or a kernel's
  forward pass) and the elementwise work are recomputed.

The names below mark those arrays (`jax.ad_checkpoint.checkpoint_name`); outside
`jax.checkpoint` they are the identity, so a model without remat computes exactly what it did.
"""

import jax
from jax.ad_checkpoint import checkpoint_name

POLICIES = ("full", "attention", "all_but_ffn_hidden", "dots")

# Checkpoint names of the arrays the names-based policies save.
QUERY = "attention_query"  # the queries as the attention core reads them (scaled, rotated)
KEY = "attention_key"
VALUE = "attention_value"
ATTENTION = "attention_output"  # the core's output (splash: its output and log-sum-exp)
ATTENTION_PROJECTION = "attention_projection"  # the output projection's output
FFN_OUTPUT = "ffn_output"  # the feed-forward's last matrix's output

_SAVED = {
    "attention": (QUERY, KEY, VALUE, ATTENTION),
    "all_but_ffn_hidden": (QUERY, KEY, VALUE, ATTENTION, ATTENTION_PROJECTION, FFN_OUTPUT),
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
