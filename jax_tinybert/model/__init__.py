"""BERT in flax.linen (modeling.py; its hyper-parameters: config.py), Hugging Face checkpoints in (hf.py) and out (export.py)."""
