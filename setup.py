from setuptools import find_packages, setup

setup(
    name="megatron_lite",
    version="0.1.0",
    description="A small, readable Megatron-style model-parallel transformer codebase in plain PyTorch",
    packages=find_packages(include=["megatron_lite", "megatron_lite.*"]),
    python_requires=">=3.10",
    # torch==2.13.0 is the pinned CPU build used in CI; any later 2.x works too.
    install_requires=["torch>=2.4", "numpy", "regex", "sentencepiece", "tensorboard", "tqdm"],
    extras_require={
        "test": ["pytest", "ruff", "matplotlib", "tokenizers"],
        "hf": ["tokenizers"],
        "plot": ["matplotlib"],
        "bench": ["transformers", "matplotlib"],
        # Optional GPU accelerators, detected at run time (see megatron_lite/device.py).
        # NVIDIA apex is source-only; the PyPI package named "apex" is unrelated: never install it.
        "gpu": ["flash-attn", "transformer-engine[pytorch]"],
    },
)
