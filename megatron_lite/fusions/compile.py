"""Regional ``torch.compile`` (``--torch-compile``), torchtitan's recipe on our modules.

What is compiled: the forward of every transformer layer, through ONE compiled function
(:func:`compile_layers`), so Dynamo traces the layer once and reuses the graph for every layer of
the same shape (the parameters are graph inputs, not constants); a model whose layers differ (a
mixture of experts in some of them) compiles once per kind. The loss is compiled too: its
per-token pieces become ``jit_fuser`` functions that compile, unless ``--jit-fuser eager`` keeps the
fused functions outside the layers eager (those inside a layer are inlined into its graph whatever
the mode); the run's start-up line says which (:func:`describe_compilation`). Embedding, final norm, output GEMM,
optimizer and the pipeline/data-parallel machinery stay eager, and the layers' module hooks
(ZeRO-3's gathers) run around the compiled forward, not inside it.

What runs eagerly inside a compiled layer (a clean graph break): every tensor-, sequence-, context-
and expert-parallel collective of :mod:`megatron_lite.parallel.comm` (they are autograd functions
around ``torch.distributed`` calls), the context-parallel core attention (ring p2p), the CPU core
attention with dropout (``models/cpu_attention.py``: traced, it fell apart into a dozen small graphs
and made the compiled fp32 step ~15% slower than eager at 6 layers, hidden 768, seq 512), the MoE
layer (data-dependent token counts), any GEMM of a precision recipe (the FP8 / Transformer Engine
GEMM seam: scaling state updated in Python) and, under ZB-H1, the GEMMs whose weight gradients W
defers (:mod:`megatron_lite.parallel.pipeline.wgrad`: the backward decides at run time). With tensor parallelism 1 a dense layer is one graph.
Gradient-accumulation fusion is off inside compiled layers: its backward calls the data-parallel
wrapper's bookkeeping, which Dynamo cannot put in a graph, so those weights' gradients reach
``main_grad`` through the wrapper's hook as without the fusion.

Dropout: Inductor is told to draw random numbers with PyTorch's own generator
(``fallback_random``), so a compiled run draws the same masks as an eager one and reproduces its
losses. Compiled kernels are cached on disk by Inductor (``TORCHINDUCTOR_CACHE_DIR``, default
``<temp dir>/torchinductor_<user>``), so a second run of the same model skips most of the compile.
"""

from __future__ import annotations

import torch

from ..console import print_rank_0
from ..errors import ConfigError
from .config import FusionConfig
from .jit import check_jit_fuser, compile_unavailable, set_jit_fuser

_compiled_forwards: dict[str, object] = {}


def check_compile_available(fusion: FusionConfig, device_type: str) -> None:
    """Refuse ``--torch-compile`` where its backend cannot build the layers (no Dynamo for this Python;
    Inductor on a CPU without a C++ compiler): one line naming the flag and the fix, before the model is
    built, instead of Inductor's traceback at the first step. The check is ``jit_fuser``'s (the
    compilers Inductor itself tries); there the fused functions fall back to eager with one line
    instead: they are optional, the layers' compile is what this flag asks for."""
    if not fusion.torch_compile:
        return
    backend = fusion.torch_compile_backend
    reason = compile_unavailable(device_type, backend)
    if reason is not None:
        fix = "use --torch-compile-backend aot_eager (no code generation) or " if "C++" in reason else ""
        raise ConfigError(f"--torch-compile (backend {backend}) on {device_type}: {reason}; {fix}drop --torch-compile")


def configure_compilation(fusion: FusionConfig, device_type: str = "cpu") -> None:
    """Apply the run's ``--jit-fuser`` / ``--torch-compile`` choices (process-wide), after
    :func:`check_compile_available` on the run's device type."""
    check_compile_available(fusion, device_type)
    mode = fusion.jit_fuser
    if fusion.torch_compile and mode == "auto":
        mode = "compile"  # the loss's pieces are compiled with the layers
    set_jit_fuser(mode, fusion.torch_compile_backend)
    check_jit_fuser(device_type)  # no compiler for the fused functions: eager, one line now
    if fusion.torch_compile:
        print_rank_0(describe_compilation(fusion))
        import torch._inductor.config as inductor_config

        from ..parallel.comm import break_graph_at_collectives

        inductor_config.fallback_random = True
        break_graph_at_collectives()


def describe_compilation(fusion: FusionConfig) -> str:
    """The start-up line of a ``--torch-compile`` run: what is compiled and what stays eager. The
    fused functions inside a compiled layer are compiled with it whatever ``--jit-fuser`` says (Dynamo
    inlines them); the ones outside the layers (the loss's cross-entropy pieces, those in the MoE
    layers and FP8 GEMMs, which run as graph breaks) follow ``--jit-fuser``: compiled unless it is
    ``eager``."""
    head = f"> --torch-compile (backend {fusion.torch_compile_backend})"
    rest = ("embedding, output layer, optimizer and the layers' graph breaks (collectives, MoE layers, "
            "precision-recipe GEMMs)")
    if fusion.jit_fuser == "eager":
        return (f"{head} with --jit-fuser eager: compiled: the transformer layers (with the fused functions inside "
                "them); eager: the loss and the fused functions outside the layers (drop --jit-fuser eager to compile "
                f"them), {rest}")
    return (f"{head}: compiled: the transformer layers (with the fused functions inside them), the loss's fused pieces "
            f"and the fused functions outside the layers; eager: {rest}")


def compiled_layer_forward(layer_forward, backend: str = "inductor"):
    """The one compiled version of ``layer_forward`` per backend (shared by every layer)."""
    if backend not in _compiled_forwards:
        _compiled_forwards[backend] = torch.compile(layer_forward, backend=backend)
    return _compiled_forwards[backend]


def run_eagerly(module: torch.nn.Module) -> None:
    """Make ``module``'s forward a graph break inside compiled regions (it runs eagerly)."""
    if not getattr(module, "_runs_eagerly", False):
        module.forward = torch.compiler.disable(module.forward)
        module._runs_eagerly = True


def layer_cache_entries(layer_forward) -> int:
    """How many times Dynamo compiled ``layer_forward``'s frame (one per distinct guard set): the
    recompile count tests check."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(layer_forward.__code__))
