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
from .outputs import wandb_folder


def check_wandb_available(config) -> None:
    """Refuse ``--wandb-project`` at start-up (on every rank, before the model is built) when the
    optional package is missing, or when W&B would need a login it does not have: no
    ``WANDB_API_KEY`` and no key for its host in the netrc file (where ``wandb login`` writes it),
    outside ``WANDB_MODE=offline`` / ``disabled``."""
    if not config.logging.wandb_project:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the optional 'wandb' package: pip install wandb "
                          "(or pip install megatron_lite[wandb]), or drop --wandb-project")
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    if not _netrc_has_key(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")):
        raise ConfigError(f"--wandb-project {config.logging.wandb_project}: no W&B login on this machine (no "
                          "WANDB_API_KEY, no key from 'wandb login'); log in, or set WANDB_MODE=offline to write the "
                          "run locally ('wandb sync' uploads it later), or drop --wandb-project")


def _netrc_has_key(base_url: str) -> bool:
    """Whether the netrc file W&B reads ($NETRC, else ~/.netrc) holds credentials for ``base_url``'s host."""
    import netrc
    from urllib.parse import urlsplit

    path = os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")
    try:
        return bool(netrc.netrc(path).authenticators(urlsplit(base_url).netloc))
    except (OSError, netrc.NetrcParseError):
        return False


class WandbWriter:
    """TensorBoard's writer interface over one W&B run: the scalars of one step are collected and
    sent as one ``run.log(..., step=step, commit=True)`` when a later step starts and on close (not
    on flush: W&B drops anything logged to a step once it is committed, and the validation scalars
    of a step come after the training scalars have been flushed)."""

    def __init__(self, config):
        import wandb

        lg = config.logging
        save_dir = wandb_folder(config)
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

        writers.append(SummaryWriter(log_dir=config.logging.tensorboard_dir, max_queue=config.logging.tensorboard_queue_size))
    if config.logging.wandb_project:
        writers.append(WandbWriter(config))
    if not writers:
        return None
    return writers[0] if len(writers) == 1 else FanOutWriter(writers)
