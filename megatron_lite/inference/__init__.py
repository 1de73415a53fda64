"""Inference: the key/value cache (kv_cache.py), sampling (sampling.py), the static-batch engine
(engine.py) and loading a checkpoint at any TP x PP layout with its tokenizer (loading.py).

Only the cache is imported here: the models import it, and the engine imports the models.
"""

from .kv_cache import KVCache

__all__ = ["KVCache"]
