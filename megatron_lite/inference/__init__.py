"""Inference: a key/value cache for incremental decoding (the engine, sampling and servers build on it)."""

from .kv_cache import KVCache

__all__ = ["KVCache"]
