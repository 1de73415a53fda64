"""Optimizer wrapper (fp32 masters, loss scaling, global-norm clipping) and learning-rate schedules."""

from .build import build_optimizer
from .clip_grads import clip_grad_norm, get_grad_norm
from .distrib_optimizer import DistributedOptimizer
from .lr_scheduler import OptimizerParamScheduler
from .optimizer import MegatronOptimizer

__all__ = [
    "DistributedOptimizer", "MegatronOptimizer", "OptimizerParamScheduler", "build_optimizer", "clip_grad_norm",
    "get_grad_norm",
]
