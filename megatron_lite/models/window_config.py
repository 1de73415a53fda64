"""Sliding-window attention flags, with Megatron-LM's names and meaning.

``--window-size LEFT RIGHT``: the query at position ``i`` sees the keys at ``i - LEFT ... i + RIGHT``
(``-1``: unbounded on that side; causal attention never sees later keys, so a GPT model uses
``RIGHT = 0``). Unset: every layer attends to its whole (causal) context.

``--window-attn-skip-freq``: which layers keep full attention. An integer ``N``: layer ``l``
(1-based) is a full-attention layer when ``l % N == 0`` (``N - 1`` sliding-window layers, then one
full layer); a list expression of one 0/1 per layer (``"[1,1,1,0]*2"``): 1 = sliding window,
0 = full attention. Unset: every layer uses the window. Multi-token prediction layers (after the
last layer) follow the integer rule, or take the last layer's entry of a list.

The masks themselves are built from token positions by :mod:`megatron_lite.parallel.sliding_window`.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..moe.layer_pattern import zero_one_list


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def parse_skip_freq(value, num_layers: int) -> list[bool]:
    """Per layer (0-based), whether it uses the sliding window. Raises ValueError with the reason."""
    if value is None:
        return [True] * num_layers
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise ValueError("must be a positive integer or a list expression of 0/1 per layer")
        return [(i + 1) % n != 0 for i in range(num_layers)]
    pattern = zero_one_list(text, num_layers)
    if pattern is None:
        raise ValueError(f"must be an integer N or a list of {num_layers} zeros and ones (1 = sliding window), "
                         "e.g. \"[1,1,1,0]\"")
    return pattern


def check_window_fields(config) -> None:
    """Validate --window-size / --window-attn-skip-freq of a TransformerConfig (one line, flag and fix)."""
    window, freq = config.window_size, config.window_attn_skip_freq
    if window is None:
        _require(freq is None, "--window-attn-skip-freq needs --window-size LEFT RIGHT; drop it or give the window")
        return
    _require(len(window) == 2 and all(int(w) >= -1 for w in window),
             f"--window-size {' '.join(map(str, window))}: give two sizes LEFT RIGHT, each -1 (unbounded) or more, "
             "e.g. --window-size 4096 0")
    _require(not config.multi_latent_attention,
             "--window-size is not supported with --multi-latent-attention (its latent key/value cache keeps "
             "every token); drop one of them")
    try:
        parse_skip_freq(freq, config.num_layers)
    except ValueError as err:
        raise ConfigError(f"--window-attn-skip-freq {freq}: {err}") from None


def check_causal_window(window) -> None:
    """A causal (GPT) model's queries never see later keys: ``RIGHT`` would do nothing, so only 0 is
    taken (or ``-1 -1``, full attention); BERT uses ``RIGHT``."""
    if window is not None and int(window[1]) != 0 and tuple(map(int, window)) != (-1, -1):
        raise ConfigError(f"--window-size {window[0]} {window[1]}: a GPT is causal (a query never sees later keys), "
                          f"so RIGHT must be 0; give --window-size {window[0]} 0 (RIGHT is for pretrain_bert.py)")


def layer_window(config, layer_number: int) -> tuple[int, int] | None:
    """The window ``(left, right)`` of global layer ``layer_number`` (1-based), or None where the layer
    attends to its whole context (no --window-size, a full layer of --window-attn-skip-freq, or -1 -1)."""
    window = getattr(config, "window_size", None)
    if window is None or tuple(window) == (-1, -1):
        return None
    freq = getattr(config, "window_attn_skip_freq", None)
    if freq is not None:
        text = str(freq).strip()
        if text.lstrip("-").isdigit():
            if layer_number % int(text) == 0:
                return None
        elif not parse_skip_freq(freq, config.num_layers)[min(layer_number, config.num_layers) - 1]:
            return None
    return int(window[0]), int(window[1])


def cache_reach(config) -> int | None:
    """How far back (``LEFT``) the decoder's layers look when every one of them is a sliding-window
    layer with a bounded left side: a key/value cache may forget every key more than that before its
    row's next query. None where some layer attends to its whole context (nothing can be forgotten)."""
    windows = [layer_window(config, n) for n in range(1, config.num_layers + 1)]
    if any(w is None or w[0] < 0 for w in windows):
        return None
    return max(w[0] for w in windows)
