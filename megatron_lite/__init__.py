"""megatron_lite: a small, readable Megatron-style model-parallel transformer codebase."""

__version__ = "0.1.0"
