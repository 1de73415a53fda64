"""Optimizer wrapper (fp32 masters, loss scaling, global-norm clipping) and learning-rate schedules."""

from .clip_grads import clip_grad_norm, get_grad_norm
from .lr_scheduler import OptimizerParamScheduler
from .optimizer import MegatronOptimizer, build_optimizer

__all__ = ["MegatronOptimizer", "OptimizerParamScheduler", "build_optimizer", "clip_grad_norm", "get_grad_norm"]
