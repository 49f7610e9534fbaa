"""rag_jax: Retrieval-Augmented Generation (Lewis et al. 2020) in JAX/Flax.

Legend used in every docstring and einsum: B batch, N docs per question, S source/context length,
T target length, V vocab, D embedding width, H hidden, K beams, C corpus size.
"""

__version__ = "0.1.0"
