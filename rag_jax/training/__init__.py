"""The trainer: its loop, step, batches, warm starts and inputs."""
