"""Teacher outputs computed once per dataset (cache.py) and shared between runs (store.py)."""
