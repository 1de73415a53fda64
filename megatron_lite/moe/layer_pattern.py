"""``--moe-layer-freq``: which layers are mixture-of-experts layers, from an integer or a list expression
(``"([0]+[1]*3)"``) evaluated without ``eval``: only int lists, ``+`` and ``*``."""

from __future__ import annotations

import ast


def parse_moe_layer_freq(value, num_layers: int) -> list[bool]:
    """Which layers (0-based) are MoE: ``N`` -> every layer with ``i % N == 0``; a list expression of
    0/1 of length num_layers (``"([0]+[1]*3)"``). Raises ValueError with the reason."""
    if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        n = int(value)
        if n < 1:
            raise ValueError(f"--moe-layer-freq {value} must be a positive integer or a list expression")
        return [i % n == 0 for i in range(num_layers)]
    pattern = eval_int_list(ast.parse(str(value).strip(), mode="eval").body)
    if not isinstance(pattern, list) or len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(f"--moe-layer-freq {value!r} must be a list of {num_layers} zeros and ones (one per layer)")
    return [bool(v) for v in pattern]


def zero_one_list(text: str, num_layers: int) -> list[bool] | None:
    """A list expression of one 0/1 per layer (``"([0]*3+[1])*2"``) as booleans; None when ``text`` is not one
    (the per-layer patterns of --window-attn-skip-freq and --no-rope-freq, whose callers word the error)."""
    try:
        pattern = eval_int_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        return None
    if not isinstance(pattern, list) or len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        return None
    return [bool(v) for v in pattern]


MAX_PATTERN = 1_000_000


def eval_int_list(node):
    """Evaluate a list expression made only of int lists, ``+`` and ``*`` (no names, no calls)."""
    if isinstance(node, ast.List):
        return [eval_int_list(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = eval_int_list(node.left), eval_int_list(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if len(items) * times > MAX_PATTERN:  # (a typo like [1]*10000000000 would fill the memory)
                raise ValueError(f"--moe-layer-freq: a list of {len(items) * times} entries is longer than any model")
            return items * times
    raise ValueError("--moe-layer-freq: only int lists, + and * are allowed, e.g. \"([0]+[1]*3)\"")
