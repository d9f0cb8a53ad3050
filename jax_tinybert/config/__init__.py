"""The config schema every stage starts from (schema.py) and the checks before a run (check.py)."""
