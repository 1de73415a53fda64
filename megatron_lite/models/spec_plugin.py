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
plain core attention, ``--num-experts`` without an MoE layer, ``--multi-latent-attention`` without
MLA).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys

from ..errors import ConfigError
from .attention import DotProductAttention
from .spec import LayerSpec, resolve_spec


def _flag(module: str, name: str) -> str:
    return f"--spec {module} {name}"


def _import(module: str, name: str):
    """The module ``module`` names: a .py file path, or a dotted name on sys.path."""
    if module.endswith(".py") or os.sep in module:
        if not os.path.isfile(module):
            raise ConfigError(f"{_flag(module, name)}: no such file {module}")
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
            raise ConfigError(f"{_flag(module, name)}: no module named {module} on PYTHONPATH; add its folder to "
                              "PYTHONPATH or give the path of its .py file") from None
        raise


@functools.cache
def load_spec(module: str, name: str):
    """The LayerSpec or ``layer_number -> LayerSpec`` function ``NAME`` of ``MODULE`` (imported once)."""
    try:
        loaded = _import(module, name)
    except ConfigError:
        raise
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(f"{_flag(module, name)}: importing {module} failed: "
                          f"{type(err).__name__}: {err}".splitlines()[0]) from None
    if not hasattr(loaded, name):
        raise ConfigError(f"{_flag(module, name)}: {module} has no attribute {name}")
    obj = getattr(loaded, name)
    if isinstance(obj, LayerSpec):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return obj
    raise ConfigError(f"{_flag(module, name)}: {name} is a {type(obj).__name__}, not a LayerSpec or a function "
                      "layer_number -> LayerSpec")


def _is(factory, cls) -> bool:
    return factory is cls or (isinstance(factory, type) and issubclass(factory, cls))


def layer_specs(module: str, name: str, num_layers: int) -> list[LayerSpec]:
    """The spec of each global layer 1..num_layers, checked to be LayerSpecs."""
    spec, specs = load_spec(module, name), []
    for layer in range(1, num_layers + 1):
        try:
            one = resolve_spec(spec, layer)
        except Exception as err:
            raise ConfigError(f"{_flag(module, name)}: {name}({layer}) raised {type(err).__name__}: "
                              f"{err}".splitlines()[0]) from None
        if not isinstance(one, LayerSpec):
            raise ConfigError(f"{_flag(module, name)}: {name}({layer}) returned a {type(one).__name__}, "
                              "not a LayerSpec")
        specs.append(one)
    return specs


def check_spec(config) -> None:
    """Refuse (ConfigError) a ``--spec`` that cannot be loaded or would silently drop one of the flags
    the default spec honours. ``config`` is the run's Config."""
    from ..moe.layer import MoELayer
    from .mla import MLASelfAttention

    if not config.model.spec:
        return
    module, name = config.model.spec
    specs = layer_specs(module, name, config.model.num_layers)
    flag = _flag(module, name)
    if config.parallel.context_parallel_size > 1 and any(_is(s.core_attention, DotProductAttention) for s in specs):
        raise ConfigError(f"{flag}: core_attention is DotProductAttention (or a subclass), which sees only this rank's part of the "
                          "sequence; with --context-parallel-size > 1 use megatron_lite.parallel.context."
                          "ContextParallelAttention (or a context-parallel module of your own)")
    if config.moe.num_experts and not any(_is(s.mlp, MoELayer) for s in specs):
        raise ConfigError(f"{flag}: --num-experts is set but no layer's mlp is megatron_lite.moe.layer.MoELayer; "
                          "use it in the spec or drop --num-experts")
    if config.model.multi_latent_attention and not any(_is(s.self_attention, MLASelfAttention) for s in specs):
        raise ConfigError(f"{flag}: --multi-latent-attention is set but no layer's self_attention is "
                          "megatron_lite.models.mla.MLASelfAttention; use it in the spec or drop the flag")
