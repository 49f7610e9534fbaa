"""Devices and processes: the `data` mesh and placements, several hosts, device memory
plans, and the host-process settings read at start-up."""
