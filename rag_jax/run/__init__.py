"""A run's plumbing, below the trainer: its settings and their start-up checks, model setup,
data, the offline index build, metrics and checkpoints."""
