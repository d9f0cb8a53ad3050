"""BERT in flax.linen (modeling.py), Hugging Face checkpoints in (hf.py) and out (export.py)."""
