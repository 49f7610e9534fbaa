"""Devices and processes: the `data` mesh and placements, several hosts, device memory
plans, the host-process settings read at start-up, preemption notices and progress lines."""
