"""Mixture of experts: router, token dispatchers, experts, shared experts and the MoE layer.

The layer (``layer.MoELayer``) fills the ``mlp`` slot of the layer spec; ``config.MoEConfig`` holds
the flags; ``metrics`` has the training-loop hooks (router-loss scale, logged losses, expert bias).
"""
