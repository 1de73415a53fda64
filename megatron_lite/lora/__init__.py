"""LoRA: low-rank adapters on the parallel linear layers, sharded like their base (see adapters.py)."""
