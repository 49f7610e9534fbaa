"""A run's plumbing: its settings and their start-up checks, the experiment built from them
(data, tokenizers, models, retriever), held-out evaluation and its metrics, checkpoints."""
