"""Devices and processes: the mesh and partitioning (sharding.py), agreement between processes (coordination.py)."""
