"""The trainer: the experiment it builds, its loop, step, batches, memos and warm starts, and the
held-out evaluation."""
