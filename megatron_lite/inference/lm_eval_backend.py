"""An lm-evaluation-harness model backend on the engine: ``--model megatron_lite``.

Importing this module registers the backend with lm-eval (lm-eval has no plugin discovery for
models, so the import is the registration): ``python tools/run_lm_eval.py --model megatron_lite
--model_args load=CKPT --tasks ...`` (lm-eval's own command line after that import), or in Python
``import megatron_lite.inference.lm_eval_backend`` then ``lm_eval.simple_evaluate(model="megatron_lite",
model_args="load=CKPT")``.

Model arguments: ``load`` (required), ``batch_size`` (16 in Python; on lm-eval's command line, which
always passes its ``--batch_size``, default 1, that one unless ``--model_args`` has its own), ``max_length`` (the model's context),
``max_gen_toks`` (256), ``dtype`` (float32, bfloat16 or float16), ``seed`` (1234), the tokenizer
overrides ``tokenizer_type``, ``vocab_file``, ``merge_file``, ``tokenizer_model``, ``vocab_size``, and
``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` under torchrun.

The three request types, as lm-eval's ``hf`` backend computes them (so the numbers match it on an
exported checkpoint with the same tokenizer):

* ``loglikelihood``: the context and continuation are tokenized together (trailing spaces of the
  context moved to the continuation; an empty context becomes the BOS token, or the end-of-document token where the tokenizer has no
  BOS), cut on the
  left to ``max_length + 1`` tokens, and the continuation's log-probs summed; ``is_greedy`` when
  every continuation token is the argmax (a continuation longer than ``max_length`` is refused,
  ConfigError: it would be scored in part);
* ``loglikelihood_rolling``: the text's tokens in disjoint windows of ``max_length`` (each predicted
  with as much context as fits, the first from that BOS or end-of-document token), log-probs summed;
* ``generate_until``: greedy (or sampled with ``do_sample`` and a ``temperature``, and ``top_k`` or
  ``top_p``) continuation of the context, cut on the left to ``max_length - max_gen_toks`` tokens,
  stopped at the end-of-document token, decoded alone (special tokens left out) and cut before the
  first ``until`` string. Any other
  generation setting (``repetition_penalty``, ``num_beams``, ...) is refused with a ConfigError
  naming it, unless it has its neutral value (``num_beams=1``, ``repetition_penalty=1.0``).

lm-eval's ``--apply_chat_template`` (with ``--fewshot_as_multiturn`` and ``--system_instruction``)
renders each prompt with the tokenizer's own chat template, as SFT data and the server's chat route
render conversations (:mod:`megatron_lite.data.chat_template`), and as the ``hf`` backend renders
them: a prompt ending with an assistant turn (a task's ``gen_prefix``) is left open for the model to
continue, and a template that refuses the system message gets the conversation without it. A text
that begins with the BOS's text (a template that writes ``{{ bos_token }}``) is tokenized without a
second BOS. A tokenizer without a chat template is refused (ConfigError, one line), as the ``hf``
backend refuses it: the default "User: ... Assistant:" template is not used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging

try:
    import lm_eval.models  # noqa: F401 - lm-eval's own backends first: it loads them only into an empty registry
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - the optional extra
    raise ImportError("the lm-eval backend needs lm-evaluation-harness: pip install megatron_lite[eval]") from err

from ..data.chat_template import ConversationError, encode, hf_chat_template, render_prompt
from ..errors import ConfigError
from ..progress import progress as progress_bar
from .cli import build_session
from .sampling import SamplingParams

GEN_KWARGS = "until, max_gen_toks, do_sample, temperature, top_k, top_p"
# Settings that change nothing at these values (some task configs spell them out); others are refused.
NEUTRAL_GEN_KWARGS = {"num_beams": 1, "repetition_penalty": 1.0, "num_return_sequences": 1, "no_repeat_ngram_size": 0}
MODEL_ARGS = ("batch_size", "max_length", "max_gen_toks", "dtype", "seed", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
              "vocab_size")
DTYPES = {"float32": (False, False), "bfloat16": (True, False), "float16": (False, True)}
logger = logging.getLogger(__name__)


def _int(name: str, value, default, minimum: int = 1):
    """A whole-number model argument (``auto`` or empty: ``default``); anything else is a ConfigError
    naming it (lm-eval hands ``--model_args`` values over as ints, floats, booleans or strings)."""
    if value in (None, "") or str(value).startswith("auto"):
        return default
    if isinstance(value, bool) or not str(value).strip().lstrip("-").isdigit() or int(value) < minimum:
        raise ConfigError(f"--model_args {name}={value}: use a whole number >= {minimum}"
                          + (" (or auto)" if name == "batch_size" else ""))
    return int(value)


def _check_args(load, dtype, unknown: dict) -> None:
    """The arguments that need no checkpoint: refused in one line (ConfigError) before any loading."""
    if unknown:
        raise ConfigError(f"--model_args {', '.join(sorted(unknown))}: not an argument of the megatron_lite backend, "
                          f"which takes load, {', '.join(MODEL_ARGS)}")
    if not load:
        raise ConfigError("--model_args load=...: the checkpoint folder is required")
    if dtype not in DTYPES:
        raise ConfigError(f"--model_args dtype={dtype}: use one of {', '.join(DTYPES)}")


@register_model("megatron_lite")
class MegatronLiteLM(TemplateLM):
    def __init__(self, load: str | None = None, batch_size=16, max_length=None, max_gen_toks=256, dtype="float32",
                 seed=1234, tensor_model_parallel_size=None, pipeline_model_parallel_size=None, tokenizer_type=None,
                 vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None, max_batch_size=None,
                 device=None, **unknown):
        super().__init__()
        _check_args(load, dtype, unknown)  # max_batch_size, device: lm-eval passes them always; unused
        bf16, fp16 = DTYPES[dtype]
        self.batch_size = _int("batch_size", batch_size, 16)
        self.max_gen_toks = _int("max_gen_toks", max_gen_toks, 256)
        args = argparse.Namespace(
            load=load, tensor_model_parallel_size=_int("tensor_model_parallel_size", tensor_model_parallel_size, None),
            pipeline_model_parallel_size=_int("pipeline_model_parallel_size", pipeline_model_parallel_size, None),
            bf16=bf16, fp16=fp16, seed=_int("seed", seed, 1234, minimum=0),
            max_sequence_length=_int("max_length", max_length, None), max_length_flag="--model_args max_length", purpose="evaluation",
            no_kv_cache=False,
            tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
            tokenizer_model=tokenizer_model, vocab_size=_int("vocab_size", vocab_size, None))
        self.session = build_session(args)
        self.engine, self.tokenizer_ = self.session.engine, self.session.tokenizer
        if self.tokenizer_.eod is None:
            raise ConfigError("the tokenizer has no end-of-document token, which lm-eval uses as the empty context")
        self.prefix_text = self.tok_decode([self.prefix_token_id])  # a text starting with it gets no second BOS

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """``--model_args`` plus what lm-eval's command line adds (``--batch_size``, which it always
        passes, default 1; ``--max_batch_size``; ``--device``): a ``batch_size`` in ``--model_args`` wins."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # -- what TemplateLM needs -------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eod

    @property
    def prefix_token_id(self) -> int:
        """The empty context (and the first rolling window's): the BOS where the tokenizer has one, as hf."""
        return self.tokenizer_.bos if getattr(self.tokenizer_, "bos", None) is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.engine.max_sequence_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The tokenizer's ids, or the text's own, without what a tokenizer.json's post-processor adds
        (a BOS), with ``add_special_tokens=False`` (lm-eval's empty context) or, as hf, for a text that
        already begins with the BOS's text (a chat template's ``{{ bos_token }}``)."""
        if add_special_tokens is False or (add_special_tokens is None and string.startswith(self.prefix_text)):
            return encode(self.tokenizer_, string)
        return self.tokenizer_.tokenize(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer_.detokenize(tokens)

    # -- chat templates (--apply_chat_template, --fewshot_as_multiturn, --system_instruction) -----
    def _template(self) -> tuple[str, dict]:
        template = hf_chat_template(self.tokenizer_)
        if template is None:
            where = (f"{self.tokenizer_.path}'s folder" if getattr(self.tokenizer_, "path", None)
                     else f"a {type(self.tokenizer_).__name__}")
            raise ConfigError(f"--apply_chat_template: the checkpoint's tokenizer has no chat template (none in {where}: "
                              "chat_template.jinja or \"chat_template\" in tokenizer_config.json), as the hf backend "
                              "refuses it too; add one beside tokenizer.json or leave out --apply_chat_template")
        return template

    def chat_template(self, chat_template=False) -> str | None:
        """The template's text, which lm-eval logs (None when no template is asked for)."""
        return None if chat_template in (False, None) else self._template()[0]

    @property
    def tokenizer_name(self) -> str:
        """Names the rendered prompts in lm-eval's request cache: a digest of the chat template and its
        special-token strings (all the rendering depends on), the same in every run and process."""
        digest = hashlib.sha256(json.dumps(self._template(), sort_keys=True).encode()).hexdigest()[:16]
        return f"megatron_lite__{digest}"

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """lm-eval's conversation as the prompt text (see the module docstring)."""
        template = self._template()
        try:
            return render_prompt(template, chat_history, add_generation_prompt)
        except ConversationError as err:
            without = [m for m in chat_history if m.get("role") != "system"]
            if len(without) == len(chat_history):
                raise ConfigError(f"--apply_chat_template: {err}") from None
            logger.warning("the chat template failed on the system message (%s); rendering without it, as hf", err)
        try:
            return render_prompt(template, without, add_generation_prompt)
        except ConversationError as err:
            raise ConfigError(f"--apply_chat_template: {err}") from None

    # -- scoring ---------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probs, whether it is the greedy continuation)`` per request."""
        longest = max((len(cont) for _, _, cont in requests), default=0)
        if longest > self.max_length:  # its first tokens would have no place in the window: a partial sum
            raise ConfigError(f"a loglikelihood continuation is {longest} tokens, longer than the model's context "
                              f"max_length {self.max_length}: it cannot be scored whole (the hf backend fails on it too)")
        items = [((ctx + cont)[-(self.max_length + 1):], len(cont)) for _, ctx, cont in requests]
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # similar lengths together
        out: list = [None] * len(items)
        bar = progress_bar(total=len(items), enabled=not disable_tqdm, desc="Scoring")
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            scored = self.engine.score([items[i][0] for i in batch])
            for i, result in zip(batch, scored):
                n = items[i][1]  # 0 when the continuation merged into the context's last token: as hf, (0, True)
                out[i] = (float(sum(result.log_probs[-n:])), all(result.greedy[-n:])) if n else (0.0, True)
            bar.update(len(batch))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, target in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, target))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _greedy) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    # -- generation ------------------------------------------------------------------------------
    def _params(self, kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """The engine's parameters for a task's ``generation_kwargs`` (see :data:`GEN_KWARGS`); a
        setting the engine cannot honour, or a value of the wrong kind, is refused (ConfigError), never ignored."""
        try:
            return self._sampling(dict(kwargs))
        except ConfigError:
            raise
        except (TypeError, ValueError) as err:
            settings = ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))
            raise ConfigError(f"generation_kwargs {settings}: {err}") from None

    def _sampling(self, kwargs: dict) -> tuple[SamplingParams, list[str]]:
        until = kwargs.pop("until", None) or []
        until = ([until] if isinstance(until, str) else list(until)) + [self.tok_decode([self.eot_token_id])]
        n = min(int(kwargs.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        top_p = kwargs.pop("top_p", None)
        top_p = 1.0 if top_p is None else float(top_p)  # 0: the most likely token only, greedy (as hf)
        sampled = bool(kwargs.pop("do_sample", False)) and temperature > 0 and top_p > 0
        top_k = int(kwargs.pop("top_k", None) or 0)
        for name, neutral in NEUTRAL_GEN_KWARGS.items():
            if name in kwargs and kwargs[name] in (None, neutral):
                kwargs.pop(name)
        if kwargs:
            raise ConfigError(f"generation_kwargs {', '.join(f'{k}={v!r}' for k, v in sorted(kwargs.items()))}: "
                             f"not supported by the megatron_lite backend, which takes {GEN_KWARGS}")
        top_p = top_p if sampled and top_p < 1.0 else 0.0
        top_k = top_k if sampled else 1
        if top_k > 0 and top_p > 0.0:
            raise ConfigError(f"generation_kwargs top_k={top_k} and top_p={top_p}: the engine takes one of them")
        params = SamplingParams(tokens_to_generate=n, top_k=top_k, temperature=temperature if sampled else 1.0,
                                top_p=top_p)
        params.check()
        return params, until

    def _decode_generated(self, tokens) -> str:
        """The generated tokens decoded on their own, special tokens left out, as hf decodes them (a
        SentencePiece-style word start then gives no leading space)."""
        hf = getattr(self.tokenizer_, "hf", None)
        return hf.decode([int(t) for t in tokens], skip_special_tokens=True) if hf is not None else self.tok_decode(tokens)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = progress_bar(total=len(requests), enabled=not disable_tqdm, desc="Generating")
        for members in groups.values():
            params, until = self._params(requests[members[0]].args[1])
            keep = max(1, self.max_length - params.tokens_to_generate)
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                prompts = [(self.tok_encode(requests[i].args[0]) or [self.eot_token_id])[-keep:] for i in batch]
                for i, result in zip(batch, self.engine.generate(prompts, params)):
                    text = self._decode_generated(result.generated)
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    out[i] = text
                bar.update(len(batch))
        bar.close()
        return out
