"""Devices and processes: the mesh and partitioning (sharding.py), starting a multi-process job
(cluster.py), agreement between processes (coordination.py)."""
