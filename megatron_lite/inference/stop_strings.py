"""Ending a sequence as soon as its text holds one of its OpenAI ``stop`` strings (as vLLM does).

The OpenAI routes cut a choice's text before its first stop string
(:func:`~.api_openai._stop_text`); without this module the engine decoded on to ``max_tokens``
past that point, holding the sequence's row and cache blocks for tokens nobody reads.
``SamplingParams.stop_strings`` asks the engine (the static batch, :meth:`InferenceEngine._steps
<.engine.InferenceEngine._steps>`, and the continuous batch, :mod:`.scheduler`) to end a sequence
at the generated token that completes one of them; that token is kept, as a stop token is, and
the answer is cut from the tokens exactly as before: the same text, ``finish_reason``, usage and
log-probs, only fewer decode steps.

Each sequence's text is followed as its tokens come by a :class:`~.detokenize.TextStream` (the
streamed answer's incremental detokenization: a window of a few tokens per step, a character whose
UTF-8 bytes are not all there yet waits for its last byte, and a stop string spanning several
tokens is searched in the tail the new token can reach). When the window finds a stop string,
the whole generated text is decoded once, as the answer is made, to confirm it; a sequence whose
window and whole text disagree (or whose tokens the tokenizer cannot decode) is not ended early
and runs on as before, so the check can only save steps, never change an answer.

Parallel layouts: only the sampling rank needs the tokenizer (``InferenceEngine.tokenizer``). It
checks the tokens it sampled and broadcasts, with them, which sequences they ended
(:func:`broadcast_tokens`), so every rank ends the same sequences at the same step.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .detokenize import TextStream, continuation_text, cut_at_stop


class StopStrings:
    """The stop strings of a batch's sequences, followed on the sampling rank (see the module docstring)."""

    def __init__(self, tokenizer, prompts: list[list[int]], stops: tuple[str, ...] | list[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.prompt_lengths = [len(p) for p in prompts]
        self.streams = [TextStream(tokenizer, p, self.stops) for p in prompts]
        self.off = [False] * len(prompts)  # not checked any more (the window and the whole text disagreed)

    def hits(self, tokens: list[int], live: list[bool]) -> list[bool]:
        """Per sequence: whether ``tokens[i]``, its new generated token (where ``live[i]``), completes
        one of its stop strings."""
        return [bool(on) and token >= 0 and self._push(i, token) for i, (token, on) in enumerate(zip(tokens, live))]

    def _push(self, i: int, token: int) -> bool:
        stream = self.streams[i]
        if self.off[i]:
            return False
        try:
            stream.push(token)
            if not stream.stopped:
                return False
            whole = SimpleNamespace(tokens=stream.tokens, prompt_length=self.prompt_lengths[i])
            found = cut_at_stop(continuation_text(self.tokenizer, whole), self.stops)[1]
        except Exception:  # noqa: BLE001 - the answer decodes again and reports it; here: no early end
            found = False
        self.off[i] = not found
        return found


def stop_checker(engine, prompts: list[list[int]], params) -> StopStrings | None:
    """The sequences' :class:`StopStrings` on the sampling rank when ``params`` has stop strings and the
    engine a tokenizer; None elsewhere."""
    tokenizer = getattr(engine, "tokenizer", None)
    if not params.stop_strings or tokenizer is None or not engine.is_src:
        return None
    return StopStrings(tokenizer, prompts, params.stop_strings)


def broadcast_tokens(engine, new: torch.Tensor, with_stops: bool, checks=()) -> tuple[torch.Tensor, torch.Tensor]:
    """``new [b]`` as the sampling rank chose it, on every rank, and ``[b]`` bool: the sequences whose
    new token completed a stop string. ``with_stops`` (the same on every rank: a request of the step
    has stop strings) sends those marks with the tokens, in the same broadcast; without it nothing
    changes (all False). ``checks``: on the sampling rank, ``(checker or None, live [rows] bool)`` for
    each run of consecutive rows, in order (``live``: the rows whose new token is generated text)."""
    b = new.numel()
    if not with_stops:
        return engine._broadcast(new), torch.zeros(b, dtype=torch.bool, device=new.device)
    marks = torch.zeros_like(new)
    if engine.is_src and any(checker is not None for checker, _ in checks):
        tokens, hits, start = new.tolist(), [], 0
        for checker, live in checks:
            rows = len(live)
            hits += [False] * rows if checker is None else checker.hits(tokens[start:start + rows], live.tolist())
            start += rows
        marks = torch.tensor(hits, dtype=torch.long, device=new.device)
    both = engine._broadcast(torch.cat([new, marks]))
    return both[:b], both[b:].bool()
