from setuptools import find_packages, setup

setup(
    name="megatron_lite",
    version="0.1.0",
    description="A small, readable Megatron-style model-parallel transformer codebase in plain PyTorch",
    packages=find_packages(include=["megatron_lite", "megatron_lite.*"]),
    python_requires=">=3.10",
    # CI pins torch==2.13.0 (installed first by .ci/run); the code needs 2.5+ (SDPA with enable_gqa).
    install_requires=["torch>=2.5", "numpy", "regex", "sentencepiece", "tensorboard", "tqdm", "matplotlib"],
    extras_require={
        # lm-eval[hf] (~240 MB with its dependencies: datasets, pandas, scikit-learn, accelerate ...) lets
        # CI compare our lm-eval backend with lm-eval's own hf backend.
        "test": ["pytest", "ruff==0.17.6", "tokenizers", "tiktoken", "pyarrow", "wandb", "transformers", "safetensors",
                 "peft", "flask", "httpx", "lm-eval[hf]",
                 "openai"],  # the server's answers read by OpenAI's own client (tests/unit/test_openai_errors.py)
        # Hugging Face tokenizers, and checkpoint export/import (tools/checkpoint/convert.py --loader/--saver hf)
        "hf": ["tokenizers", "safetensors", "transformers"],
        # Compiled GPT-2 BPE for GPT-2's own vocabulary (megatron_lite/data/gpt2_fast.py); the
        # pure-Python encoder is used without it.
        "fast": ["tiktoken"],
        # --tokenizer-type TikTokenizer (megatron_lite/data/tiktoken_tokenizer.py), imported only by it.
        "tiktoken": ["tiktoken"],
        # Parquet corpora as preprocessing input (megatron_lite/data/parquet_input.py).
        "parquet": ["pyarrow"],
        # --wandb-project (megatron_lite/training/writers.py); WANDB_MODE=offline needs no network.
        "wandb": ["wandb"],
        "bench": ["transformers"],
        # tools/run_text_generation_server.py (Flask; Jinja2 renders chat templates).
        "serve": ["flask"],
        # lm-evaluation-harness with the megatron_lite model backend (tools/run_lm_eval.py).
        "eval": ["lm-eval"],
        # Optional GPU accelerators, detected at run time (see megatron_lite/device.py).
        # NVIDIA apex is source-only; the PyPI package named "apex" is unrelated: never install it.
        "gpu": ["flash-attn", "transformer-engine[pytorch]"],
    },
)
