"""Side-by-side benchmarks of rag_jax against its references (`python -m benchmarks.run`)."""
