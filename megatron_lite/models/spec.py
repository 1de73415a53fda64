"""Layer specs: which module fills each part of a transformer layer.

A transformer layer is ``x + drop(self_attention(input_norm(x)))`` then
``x + drop(mlp(pre_mlp_norm(x)))``. :class:`LayerSpec` names the module behind each part as a
factory ``(config, state, layer_number) -> nn.Module`` (``layer_number`` global, 1-based), so a
variant is a different spec, not a change to the layer:

* a new attention variant (ring attention over a context-parallel group, a fused kernel):
  ``core_attention`` - gets ``q, k, v [s, b, heads, d]``, returns ``[s, b, heads * d]``;
* a new MLP or a mixture of experts: ``mlp`` - gets and returns ``[s(/tp), b, h]``;
* a different attention block altogether (cross-attention, latent attention): ``self_attention``,
  called as ``factory(config, state, layer_number, core_attention=spec.core_attention)``;
* norms: ``input_norm`` / ``pre_mlp_norm``; ``final_norm``, the norm after the last layer, is taken
  from the last layer's spec (``factory(config, state, num_layers)``); so are the multi-token prediction
  depths' norms (``enorm`` / ``hnorm``: ``input_norm``, ``final_layernorm``: ``final_norm``).

A part whose factory is None is left out with its norm: ``self_attention=None`` (an MLP-only layer) or
``mlp=None`` (an attention-only or Mamba layer), as :func:`hybrid_layer_spec` builds hybrid Mamba models.

A model passes either one spec for every layer or a function ``layer_number -> LayerSpec`` (for
example a mixture of experts in every other layer). GEMM precision is not part of the spec: every
parallel linear asks ``config.make_gemm`` (see :class:`~megatron_lite.models.transformer_config.TransformerConfig`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError
from ..moe.config import moe_layer_pattern
from ..moe.layer import MoELayer
from ..parallel.context import ContextParallelAttention
from .attention import DotProductAttention, SelfAttention
from .common import Norm
from .mamba import MambaMixer
from .mamba_config import ATTENTION, MAMBA, hybrid_layers, is_hybrid
from .mla import MLASelfAttention
from .mlp import MLP

Factory = Callable[..., nn.Module]


@dataclass(frozen=True)
class LayerSpec:
    input_norm: Factory = Norm.from_config
    self_attention: Factory = SelfAttention
    core_attention: Factory = DotProductAttention
    pre_mlp_norm: Factory = Norm.from_config
    mlp: Factory = MLP
    final_norm: Factory = Norm.from_config  # read from the last layer's spec only


def resolve_spec(spec, layer_number: int) -> LayerSpec:
    """The spec of global layer ``layer_number`` from one spec or a per-layer function."""
    return spec if isinstance(spec, LayerSpec) else spec(layer_number)


def gpt_layer_spec(config) -> LayerSpec | Callable[[int], LayerSpec]:
    """GPT's layers: pre-norm self-attention with dot-product core attention and the dense MLP, or
    the MoE layer in the layers ``--moe-layer-freq`` selects when the model has experts. Under
    context parallelism the core attention is the context-parallel one (ring / a2a / allgather);
    with ``--multi-latent-attention`` the attention block is MLA (:mod:`~megatron_lite.models.mla`).
    With ``--spec MODULE NAME`` (``config.spec``, saved with checkpoints) the user's spec instead, so
    every tool that builds a model from a config builds that one (:func:`load_spec`; checked against
    the other flags by :mod:`~megatron_lite.models.spec_plugin`)."""
    if getattr(config, "spec", None):
        return load_spec(*config.spec)
    if is_hybrid(config):
        return hybrid_layer_spec(config)
    attention = {"core_attention": ContextParallelAttention} if getattr(config, "context_parallel_size", 1) > 1 else {}
    if getattr(config, "multi_latent_attention", False):
        attention["self_attention"] = MLASelfAttention
    if not config.num_experts:
        return LayerSpec(**attention)
    pattern = moe_layer_pattern(config)
    dense, moe = LayerSpec(**attention), LayerSpec(mlp=MoELayer, **attention)
    return lambda layer_number: moe if pattern[layer_number - 1] else dense


def hybrid_layer_spec(config) -> Callable[[int], LayerSpec]:
    """A hybrid Mamba model's layers (:mod:`~megatron_lite.models.mamba_config`): one part each, ``M`` the
    Mamba-2 mixer in the attention slot, ``*`` self-attention, ``-`` the MLP (a part set to None is skipped)."""
    specs = {MAMBA: LayerSpec(self_attention=MambaMixer, pre_mlp_norm=None, mlp=None),
             ATTENTION: LayerSpec(pre_mlp_norm=None, mlp=None), "-": LayerSpec(input_norm=None, self_attention=None)}
    kinds = hybrid_layers(config)
    return lambda layer_number: specs[kinds[layer_number - 1]]


def bert_layer_spec(config) -> LayerSpec | Callable[[int], LayerSpec]:
    """BERT's layers (Megatron's BERT is pre-LayerNorm like GPT): the same parts as GPT's, experts
    included; the bidirectional padding mask is the block's ``attn_mask_type``, not a different module."""
    return gpt_layer_spec(config)


# --spec MODULE NAME: the user's spec, loaded here (its checks against the other flags: spec_plugin.py)
def spec_flag(module: str, name: str) -> str:
    return f"--spec {module} {name}"


def is_path(module: str) -> bool:
    """``MODULE`` names a .py file (imported from that path), not a dotted module name."""
    return module.endswith(".py") or os.sep in module


def resolved(spec):
    """``(MODULE, NAME)`` with a file path made absolute (relative to the working directory) and its
    links resolved: the same file named two ways is the same spec (anything else: itself)."""
    if not (isinstance(spec, (list, tuple)) and len(spec) == 2):
        return spec
    module, name = spec
    return (os.path.realpath(module) if is_path(module) else module), name


def _import(module: str, name: str):
    """The module ``module`` names: a .py file path, or a dotted name on sys.path."""
    if is_path(module):
        if not os.path.isfile(module):
            raise ConfigError(f"{spec_flag(module, name)}: no such file {module}")
        stem = os.path.splitext(os.path.basename(module))[0]
        loader_spec = importlib.util.spec_from_file_location(f"megatron_lite_spec_{stem}", module)
        loaded = importlib.util.module_from_spec(loader_spec)
        sys.modules[loader_spec.name] = loaded  # dataclasses and pickling look classes up here
        try:
            loader_spec.loader.exec_module(loaded)
        except BaseException:
            sys.modules.pop(loader_spec.name, None)
            raise
        return loaded
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):  # the module itself, not one it imports
            raise ConfigError(f"{spec_flag(module, name)}: no module named {module} on PYTHONPATH; add its folder to "
                              "PYTHONPATH or give the path of its .py file") from None
        raise


@functools.cache
def load_spec(module: str, name: str):
    """The LayerSpec or ``layer_number -> LayerSpec`` function ``NAME`` of ``MODULE`` (imported once)."""
    try:
        loaded = _import(module, name)
    except ConfigError:
        raise
    except (Exception, SystemExit) as err:  # the user's module raised (or called sys.exit: a script) while importing
        raise ConfigError(f"{spec_flag(module, name)}: importing {module} failed: "
                          f"{type(err).__name__}: {err}".splitlines()[0]) from None
    if not hasattr(loaded, name):
        raise ConfigError(f"{spec_flag(module, name)}: {module} has no attribute {name}")
    obj = getattr(loaded, name)
    if isinstance(obj, LayerSpec):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return obj
    raise ConfigError(f"{spec_flag(module, name)}: {name} is a {type(obj).__name__}, not a LayerSpec or a function "
                      "layer_number -> LayerSpec")
