"""Mixed precision: fp16 loss scaling (the fp32 master weights live in optim/optimizer.py)."""

from .loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "build_loss_scaler"]
