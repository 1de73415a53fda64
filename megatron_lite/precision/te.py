"""``--transformer-impl transformer_engine``: the transformer layers' GEMMs through Transformer Engine.

:class:`TeGemm` plugs into the same GEMM seam as :class:`~megatron_lite.precision.fp8.Fp8Gemm`
(``gemm(x, weight, bias) -> x @ weight.T + bias`` on this rank's shard). It runs
``transformer_engine.pytorch.Linear`` (bias-free, ``tp_size`` 1) on *our* weight tensor: the
tensor-parallel layers around the seam still do every all-gather and reduction, TE only replaces
the local GEMM, and the weights, their initialisation and their checkpoints stay ours. The TE
module is made on the first call (the seam learns the weight's shape only then) and is kept out of
the module tree, so its copy of the weight never enters our state dict; each call points it at the
weight it is given, which also serves views such as a grouped expert's slice.

With an FP8 recipe the call runs under ``fp8_autocast`` with a TE recipe built from our flags:

* ``--fp8-format hybrid|e4m3`` -> ``Format.HYBRID`` / ``Format.E4M3``;
* ``--fp8-recipe delayed`` -> ``DelayedScaling(margin, fp8_format, amax_history_len,
  amax_compute_algo)``; ``--no-fp8-wgrad`` adds ``override_linear_precision=(False, False, True)``;
* ``--fp8-recipe tensorwise`` -> ``Float8CurrentScaling(fp8_format)``, ``blockwise`` ->
  ``Float8BlockScaling(fp8_format)``, ``mxfp8`` -> ``MXFP8BlockScaling(fp8_format)`` (as Megatron);
* amaxes are reduced by TE over ``fp8_group`` = the gemm's amax group (tensor x context parallel for
  the dense layers, ``expert_amax`` for the experts: as :class:`~megatron_lite.precision.fp8.Fp8Gemm`);
* the input is flattened to 2-D and, under FP8, padded with zero rows to a multiple of 16 rows (an
  MoE expert receives any number of tokens; TE's FP8 GEMMs need aligned dimensions).

TE then keeps its own scaling state (amax history, scales) inside its module: it is not in our
checkpoints, and our per-step :func:`~megatron_lite.precision.fp8.update_fp8_scales` does not see
it. Without an FP8 recipe (bf16 runs, or layers kept in bf16) the GEMM runs in TE unscaled.
"""

from __future__ import annotations

import importlib

from torch import nn

from ..errors import ConfigError
from .flags import transformer_engine_missing
from .fp8_ops import pad_rows

ROW_ALIGNMENT = 16


def import_transformer_engine():
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, or ConfigError naming the fix."""
    missing = transformer_engine_missing()
    if missing:
        raise ConfigError(f"--transformer-impl transformer_engine: {' and '.join(missing)}; "
                          "use --transformer-impl local (native FP8 GEMMs)")
    return (importlib.import_module("transformer_engine.pytorch"),
            importlib.import_module("transformer_engine.common.recipe"))


def te_recipe(recipe, recipe_module):
    """The TE recipe object for our :class:`~megatron_lite.precision.fp8.Fp8Recipe` (None: no FP8)."""
    if recipe is None:
        return None
    fmt = recipe_module.Format.HYBRID if recipe.format == "hybrid" else recipe_module.Format.E4M3
    current = {"tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}
    if recipe.recipe in current:
        if not recipe.wgrad:
            raise ConfigError(f"--no-fp8-wgrad with --fp8-recipe {recipe.recipe} is not available through "
                              "Transformer Engine; use --fp8-recipe delayed or --transformer-impl local")
        return getattr(recipe_module, current[recipe.recipe])(fp8_format=fmt)
    fields = dict(margin=recipe.margin, fp8_format=fmt, amax_history_len=recipe.amax_history_len,
                  amax_compute_algo=recipe.amax_compute_algo)
    if not recipe.wgrad:
        fields["override_linear_precision"] = (False, False, True)  # (fprop, dgrad, wgrad) in high precision
    try:
        return recipe_module.DelayedScaling(**fields)
    except TypeError as err:
        raise ConfigError(f"this Transformer Engine's DelayedScaling does not take {sorted(fields)} ({err}); "
                          "use --transformer-impl local") from None


class TeGemm(nn.Module):
    """One linear layer's GEMM through Transformer Engine: ``gemm(x, weight, bias=None)``.

    ``recipe``: our FP8 recipe, or None for an unscaled (bf16) TE GEMM. ``amax_group``: the group TE
    reduces amaxes over (tensor x context parallel). TE must be importable and a GPU visible.
    """

    def __init__(self, recipe=None, amax_group=None):
        super().__init__()
        self.te, recipe_module = import_transformer_engine()
        self.recipe = recipe
        self.te_recipe = te_recipe(recipe, recipe_module)
        self.amax_group = amax_group
        self._linear = {}  # (in, out, dtype, device) -> TE Linear; a dict keeps it out of the module tree

    def _te_linear(self, weight):
        key = (weight.shape[1], weight.shape[0], weight.dtype, str(weight.device))
        if key not in self._linear:
            self._linear[key] = self.te.Linear(weight.shape[1], weight.shape[0], bias=False,
                                               params_dtype=weight.dtype, device=weight.device)
        linear = self._linear[key]
        # run on our weight (a Parameter, or a view of one): TE reads it back from its parameters
        linear._parameters["weight"] = weight
        return linear

    def forward(self, x, weight, bias=None):
        linear = self._te_linear(weight)
        rows = x.reshape(-1, x.shape[-1])
        if self.te_recipe is not None:  # TE's FP8 GEMMs want the token count aligned too (an expert's is
            rows = pad_rows(rows, ROW_ALIGNMENT)  # arbitrary); zero rows change no amax and no wgrad
        with self.te.fp8_autocast(enabled=self.te_recipe is not None, fp8_recipe=self.te_recipe,
                                  fp8_group=self.amax_group):
            out = linear(rows)
        out = out[: x.shape[:-1].numel()].reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return "Transformer Engine" + ("" if self.recipe is None else f", FP8 {self.recipe.describe()}")
