"""Where the training scalars go: TensorBoard (``--tensorboard-dir``), Weights & Biases
(``--wandb-project``), both, or neither.

The logger talks to one object with TensorBoard's ``add_scalar(name, value, step)``, ``flush()`` and
``close()``; with both sinks it is a :class:`FanOutWriter`, so W&B receives exactly the scalars, names
and steps TensorBoard does. W&B is optional (``pip install wandb`` or ``megatron_lite[wandb]``); its
``WANDB_MODE=offline`` mode writes the run under ``--wandb-save-dir`` without any network, to be
uploaded later with ``wandb sync``. Only the logging rank builds a writer.
"""

from __future__ import annotations

import importlib.util
import os

from ..errors import ConfigError


def check_wandb_available(config) -> None:
    """Refuse ``--wandb-project`` early (on every rank) when the optional package is missing."""
    if config.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the optional 'wandb' package: pip install wandb "
                          "(or pip install megatron_lite[wandb]), or drop --wandb-project")


class WandbWriter:
    """TensorBoard's writer interface over one W&B run: the scalars of one step are collected and
    sent as one ``run.log(..., step=step, commit=True)`` when a later step starts and on close (not
    on flush: W&B drops anything logged to a step once it is committed, and the validation scalars
    of a step come after the training scalars have been flushed)."""

    def __init__(self, config):
        import wandb

        lg = config.logging
        save_dir = lg.wandb_save_dir or (os.path.join(config.checkpoint.save, "wandb") if config.checkpoint.save
                                         else os.path.abspath("wandb"))
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name or None, dir=save_dir,
                              config=config.flat())
        self.step, self.pending = None, {}

    def add_scalar(self, name: str, value, step: int) -> None:
        if self.step is not None and int(step) != self.step:
            self._send()
        self.step = int(step)
        self.pending[name] = float(value)

    def _send(self) -> None:
        if self.pending:
            self.run.log(self.pending, step=self.step, commit=True)
            self.pending = {}

    def flush(self) -> None:
        pass  # see the class docstring; W&B's service process writes what it has been sent

    def close(self) -> None:
        self._send()
        self.run.finish()


class FanOutWriter:
    """Several writers behind one: every call goes to each of them, in order."""

    def __init__(self, writers):
        self.writers = list(writers)

    def add_scalar(self, name: str, value, step: int) -> None:
        for w in self.writers:
            w.add_scalar(name, value, step)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def build_writer(config):
    """The writer for the configured sinks, or None when there are none."""
    writers = []
    if config.logging.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        writers.append(SummaryWriter(log_dir=config.logging.tensorboard_dir, max_queue=1000))
    if config.logging.wandb_project:
        writers.append(WandbWriter(config))
    if not writers:
        return None
    return writers[0] if len(writers) == 1 else FanOutWriter(writers)
