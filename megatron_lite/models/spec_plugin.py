"""``--spec MODULE NAME``: a layer spec from the user's own module, without editing a training script.

``MODULE`` is a module on ``PYTHONPATH`` (``my_project.layers``) or the path of a ``.py`` file
(``./my_layers.py``); ``NAME`` in it is either a :class:`~megatron_lite.models.spec.LayerSpec` (every
layer the same) or a function ``layer_number -> LayerSpec`` (global, 1-based layer numbers). It
replaces the default spec of every layer: :func:`~megatron_lite.models.spec.gpt_layer_spec` (and
``bert_layer_spec``) return it when the model's config has ``spec``, which the flag sets and
checkpoints save, so a tool rebuilding the model from a checkpoint builds the same one. Anything else is refused in one line naming ``--spec``
(:class:`~megatron_lite.errors.ConfigError`, exit code 2), before a process group or model exists:
a module that cannot be imported, a missing name, an object that is neither, a function that does not
return a LayerSpec, and a spec that would silently drop a flag (``--context-parallel-size`` > 1 with
a core attention that is neither ContextParallelAttention nor a class setting ``context_parallel = True``, MoELayer in other layers than ``--moe-layer-freq`` (default 1: every layer) selects
or without ``--num-experts``, ``--num-experts`` without an MoE layer, ``--multi-latent-attention`` with a
layer whose self_attention is not MLASelfAttention, or MLASelfAttention without the flag, ``--qk-layernorm`` with a layer whose attention block is neither of the two that norm queries and
keys, ``--qk-l2-norm``, ``--add-qkv-bias``, ``--rotary-interleaved``, ``--attention-output-gate`` or ``--no-rope-freq`` with a layer whose block is not SelfAttention, ``--window-size``
or ``--softmax-type`` other than vanilla with a core attention that is not built on the stock one, an
MLP activation flag such as ``--swiglu`` with an mlp that is neither the stock MLP nor MoELayer,
``--normalization RMSNorm`` or ``--apply-layernorm-1p`` with a norm of one's own).
A factory counts as the class it builds when it is a ``functools.partial`` of it or sets
``__wrapped__`` to it (``functools.wraps``), as ``examples/research/int8_gemm.py`` does.
"""

from __future__ import annotations

import functools
import inspect

from ..errors import ConfigError
from ..parallel.context import ContextParallelAttention
from .attention import DotProductAttention, SelfAttention
from .common import Norm
from .mlp import MLP
from .spec import LayerSpec, load_spec, resolve_spec, spec_flag


def _unwrap(factory):
    """The class behind a factory that builds it: ``functools.partial(Cls, ...)``, or a function
    that sets ``__wrapped__ = Cls`` (as ``functools.wraps`` does, e.g. examples/research/int8_gemm.py)."""
    while True:
        if isinstance(factory, functools.partial):
            factory = factory.func
        elif not isinstance(factory, type) and hasattr(factory, "__wrapped__"):
            factory = inspect.unwrap(factory)
        else:
            return factory


def _is(factory, cls) -> bool:
    """``factory`` is the class ``cls`` (or one of a tuple of classes) or a subclass, directly or
    through a partial / ``__wrapped__`` factory (:func:`_unwrap`)."""
    classes = cls if isinstance(cls, tuple) else (cls,)
    factory = _unwrap(factory)
    return factory in classes or (isinstance(factory, type) and issubclass(factory, classes))


def layer_specs(module: str, name: str, num_layers: int) -> list[LayerSpec]:
    """The spec of each global layer 1..num_layers, checked to be LayerSpecs."""
    spec, specs = load_spec(module, name), []
    for layer in range(1, num_layers + 1):
        try:
            one = resolve_spec(spec, layer)
        except Exception as err:
            raise ConfigError(f"{spec_flag(module, name)}: {name}({layer}) raised {type(err).__name__}: "
                              f"{err}".splitlines()[0]) from None
        if not isinstance(one, LayerSpec):
            raise ConfigError(f"{spec_flag(module, name)}: {name}({layer}) returned a {type(one).__name__}, "
                              "not a LayerSpec")
        specs.append(one)
    return specs


# MLP activation flags (config.model field -> flag) that only the stock MLP and the MoE experts read
MLP_FLAGS = {"swiglu": "--swiglu", "squared_relu": "--squared-relu", "quick_geglu": "--quick-geglu",
             "openai_gelu": "--openai-gelu", "glu_linear_offset": "--glu-linear-offset",
             "activation_func_clamp_value": "--activation-func-clamp-value"}


def _check_mlp_flags(model, specs: list[LayerSpec], flag: str) -> None:
    """Refuse an MLP activation flag when a layer's mlp is neither the stock MLP nor MoELayer (a custom
    MLP has its own activation: the flag would be silently dropped there)."""
    from ..moe.layer import MoELayer

    custom = [s.mlp for s in specs if not _is(s.mlp, (MLP, MoELayer))]
    given = [MLP_FLAGS[f] for f in MLP_FLAGS if getattr(model, f, None) not in (None, False, 0.0)]
    if custom and given:
        raise ConfigError(f"{flag}: {given[0]} is set but mlp {getattr(custom[0], '__name__', custom[0])} has its own "
                          "activation and does not apply it; subclass megatron_lite.models.mlp.MLP in the spec or drop "
                          f"{given[0]}")


def _stock_norm(factory) -> bool:
    """``factory`` builds the stock norm: ``Norm.from_config`` (the default), Norm or a subclass (or its from_config)."""
    owner = getattr(_unwrap(factory), "__self__", None)  # a classmethod's class
    return _is(factory, Norm) or (isinstance(owner, type) and issubclass(owner, Norm))


def _check_norm_flags(model, specs: list[LayerSpec], flag: str) -> None:
    """Refuse a norm flag when a norm of the spec (a layer's two, or the final one of the last layer's
    spec) is one of the user's own: it would not read the flag."""
    norms = [f for s in specs for f in (s.input_norm, s.pre_mlp_norm)] + [specs[-1].final_norm]
    custom = [f for f in norms if not _stock_norm(f)]
    given = [name for name, on in (("--normalization RMSNorm", model.normalization != "LayerNorm"),
                                   ("--apply-layernorm-1p", model.apply_layernorm_1p)) if on]
    if custom and given:
        raise ConfigError(f"{flag}: {given[0]} is set but norm {getattr(_unwrap(custom[0]), '__name__', custom[0])} is "
                          f"one of its own and does not apply it; subclass megatron_lite.models.common.Norm in the spec "
                          f"or drop {given[0].split()[0]}")


def _check_moe_layers(moe, specs: list[LayerSpec], flag: str) -> None:
    """Refuse a spec whose MoELayer layers are not the ones ``--moe-layer-freq`` selects (its default 1
    is every layer): the FLOPs count, the per-layer router logging and the recompute checks read the
    flag, and MoELayer needs ``--num-experts``."""
    from ..moe.layer import MoELayer
    from ..moe.layer_pattern import parse_moe_layer_freq

    in_spec = [_is(s.mlp, MoELayer) for s in specs]
    if not moe.num_experts:
        if any(in_spec):
            raise ConfigError(f"{flag}: layer {in_spec.index(True) + 1}'s mlp is megatron_lite.moe.layer.MoELayer "
                              "but --num-experts is not set; set --num-experts (and --moe-layer-freq to the spec's "
                              "MoE layers) or use another mlp")
        return
    if not any(in_spec):
        raise ConfigError(f"{flag}: --num-experts is set but no layer's mlp is megatron_lite.moe.layer.MoELayer; "
                          "use it in the spec or drop --num-experts")
    freq, pattern = moe.moe_layer_freq, parse_moe_layer_freq(moe.moe_layer_freq, len(specs))
    if pattern != in_spec:
        match, selected = ("[" + ",".join(str(int(v)) for v in p) + "]" for p in (in_spec, pattern))
        default = " (the default: every layer)" if str(freq).strip() == "1" else ""
        raise ConfigError(f"{flag}: the spec puts MoELayer in the layers {match} but --moe-layer-freq {freq}{default} "
                          f"selects {selected}; pass --moe-layer-freq \"{match}\" to match the spec, or change the spec")


def _context_parallel(factory) -> bool:
    """A core attention that attends across the context-parallel ranks: the stock one, or a module of
    one's own whose class says so (``context_parallel = True``)."""
    return _is(factory, ContextParallelAttention) or getattr(_unwrap(factory), "context_parallel", False) is True


def _first_other(specs: list[LayerSpec], cls) -> int | None:
    """The first layer (1-based) whose self_attention is not ``cls`` (a flag only ``cls`` applies would be
    dropped there, even if other layers apply it), else None."""
    return next((i for i, s in enumerate(specs, 1) if not _is(s.self_attention, cls)), None)


def _check_mla_layers(model, specs: list[LayerSpec], flag: str) -> None:
    """``--multi-latent-attention`` describes every layer: it sizes the rotary tables (the
    --qk-pos-emb-head-dim channels MLA rotates, else the head's), sets the softmax scale (MLA's, from
    --qk-head-dim + --qk-pos-emb-head-dim) and makes --kv-lora-rank and the other MLA sizes apply. A
    layer whose self_attention disagrees with it (stock attention under the flag, MLASelfAttention
    without it) would get the other kind's tables and scale: refused, naming the first such layer."""
    from .mla import MLASelfAttention

    is_mla = [_is(s.self_attention, MLASelfAttention) for s in specs]
    if model.multi_latent_attention and not all(is_mla):
        layer = is_mla.index(False) + 1
        raise ConfigError(f"{flag}: --multi-latent-attention is set but layer {layer}'s self_attention is not "
                          "megatron_lite.models.mla.MLASelfAttention (the flag sets every layer's rotary tables and "
                          "softmax scale for MLA); use MLASelfAttention (or a subclass) in every layer or drop the flag")
    if not model.multi_latent_attention and any(is_mla):
        layer = is_mla.index(True) + 1
        raise ConfigError(f"{flag}: layer {layer}'s self_attention is megatron_lite.models.mla.MLASelfAttention but "
                          "--multi-latent-attention is not set (the flag sets MLA's rotary tables, softmax scale and "
                          "--kv-lora-rank / head sizes); add --multi-latent-attention or use another self_attention")


def check_spec(config) -> None:
    """Refuse (ConfigError) a ``--spec`` that cannot be loaded or would silently drop one of the flags
    the default spec honours. ``config`` is the run's Config."""
    from .mla import MLASelfAttention

    if not config.model.spec:
        return
    module, name = config.model.spec
    specs = layer_specs(module, name, config.model.num_layers)
    flag = spec_flag(module, name)
    local = [s.core_attention for s in specs if not _context_parallel(s.core_attention)]
    if config.parallel.context_parallel_size > 1 and local:
        what = "DotProductAttention (or a subclass)" if _is(local[0], DotProductAttention) else \
            getattr(_unwrap(local[0]), "__name__", local[0])
        raise ConfigError(f"{flag}: core_attention is {what}, which sees only this rank's part of the sequence; with "
                          "--context-parallel-size > 1 use megatron_lite.parallel.context.ContextParallelAttention (or a "
                          "module of your own that attends across the context-parallel ranks and sets context_parallel = True)")
    _check_moe_layers(config.moe, specs, flag)
    if config.model.qk_layernorm and (layer := _first_other(specs, (SelfAttention, MLASelfAttention))):
        raise ConfigError(f"{flag}: --qk-layernorm is set but layer {layer}'s self_attention is not megatron_lite.models."
                          "attention.SelfAttention or MLASelfAttention (the blocks that norm queries and keys); use "
                          "one in the spec or drop the flag")
    for field, name in (("qk_l2_norm", "--qk-l2-norm"), ("add_qkv_bias", "--add-qkv-bias"),  # SelfAttention's alone
                        ("rotary_interleaved", "--rotary-interleaved"), ("attention_output_gate", "--attention-output-gate"),
                        ("no_rope_freq", "--no-rope-freq")):
        if getattr(config.model, field, False) and (layer := _first_other(specs, SelfAttention)):
            raise ConfigError(f"{flag}: {name} is set but layer {layer}'s self_attention is not megatron_lite.models."
                              "attention.SelfAttention (the block that applies it); use it in the spec or drop the flag")
    _check_mla_layers(config.model, specs, flag)
    _check_mlp_flags(config.model, specs, flag)
    _check_norm_flags(config.model, specs, flag)
    window = config.model.window_size
    plain = [s.core_attention for s in specs if not any(_is(s.core_attention, c) for c in (DotProductAttention,
                                                                                        ContextParallelAttention))]
    if window is not None and tuple(window) != (-1, -1) and plain:
        raise ConfigError(f"{flag}: --window-size is set but core_attention {getattr(plain[0], '__name__', plain[0])} "
                          "does not apply it; subclass DotProductAttention in the spec or drop --window-size")
    if config.model.softmax_type != "vanilla" and plain:
        raise ConfigError(f"{flag}: --softmax-type {config.model.softmax_type} is set but core_attention "
                          f"{getattr(plain[0], '__name__', plain[0])} has no sink; subclass DotProductAttention in the "
                          "spec or drop --softmax-type")
