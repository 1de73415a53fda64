"""Pretrain a GPT model with tensor, sequence, context, pipeline and data parallelism.

    python pretrain_gpt.py --mock-data --vocab-size 512 ...                     # one process
    torchrun --standalone --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --data-path my_text_document ...         # four

Flags are Megatron-LM's (``--help`` lists them). This file only says what is GPT-specific: how
to build the model chunks of this rank, how one micro-batch is fed and its loss computed, and
which datasets to read; ``megatron_lite.training.pretrain`` does the rest.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import CheckpointError
from megatron_lite.config import Config, ConfigError
from megatron_lite.console import print_rank_0
from megatron_lite.data.builder import (
    DataConfigError,
    build_train_valid_test_datasets,
    build_validation_sets,
    data_flags,
    dataset_config_from_args,
    train_valid_test_num_samples,
)
from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.data.samplers import chunk_data_iterators
from megatron_lite.data.sft_dataset import build_sft_datasets, read_sft_data, sft_config_from
from megatron_lite.data.tokenizers import build_tokenizer, tiktoken_kwargs
from megatron_lite.device import get_device
from megatron_lite.errors import exit_if_a_peer_stopped, exit_with_message, is_rank_local, run_script
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.models.mtp import mtp_targets
from megatron_lite.models.window_config import check_causal_window
from megatron_lite.parallel.context import get_batch_on_this_cp_rank
from megatron_lite.parallel.pipeline import pipeline_ranges
from megatron_lite.training.eval_batch import eval_config
from megatron_lite.training.loop import pretrain
from megatron_lite.training.nonfinite import NonFiniteError
from megatron_lite.training.rerun import StopEveryRank
from megatron_lite.training.validation import split_samples, test_set, validation_sets


def build_tokenizer_for(config: Config):
    d = config.data
    kind = d.tokenizer_type or "NullTokenizer"
    return build_tokenizer(
        kind, vocab_file=d.vocab_file, merge_file=d.merge_file, tokenizer_model=d.tokenizer_model,
        vocab_size=config.model.vocab_size, **tiktoken_kwargs(d),
    )


def set_vocab(config: Config, tokenizer) -> None:
    """The tokenizer's vocabulary size, and the padded size the model derives from it (saved with checkpoints);
    a --vocab-size that differs from it (a tokenizer other than NullTokenizer) is refused, not ignored."""
    m, kind = config.model, config.data.tokenizer_type
    if kind not in (None, "NullTokenizer") and m.vocab_size not in (None, tokenizer.vocab_size):
        raise ConfigError(f"--vocab-size {m.vocab_size} with --tokenizer-type {kind}: the vocabulary is the tokenizer's "
                          f"({tokenizer.vocab_size} tokens; --vocab-size sizes NullTokenizer's and TikTokenizer's only); drop "
                          "--vocab-size")
    m.vocab_size, m.padded_vocab_size = tokenizer.vocab_size, None
    m.padded_vocab_size = TransformerConfig.from_config(config).padded_vocab_size


def my_layer_ranges(config: Config, state) -> list[tuple[int, int]]:
    """(first, last + 1) global layer of each model chunk of this pipeline rank."""
    return pipeline_ranges(config.flat())[state.pp_rank]


def model_provider(config: Config, state) -> list[torch.nn.Module]:
    """The model chunks this rank holds: one per virtual pipeline stage (one without interleaving)."""
    model_config = TransformerConfig.from_config(config)
    ranges = my_layer_ranges(config, state)
    return [
        GPTModel(model_config, state, pre_process=state.is_first_stage() and i == 0,
                 post_process=state.is_last_stage() and i == len(ranges) - 1, layer_start=start, layer_end=end)
        for i, (start, end) in enumerate(ranges)
    ]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, cp_group=None, mtp_loss_mask=None,
              mtp_loss_scaling_factor: float = 0.1, per_token: bool = False):
    """Mean per-token loss over the unmasked tokens of the micro-batch.

    Under context parallelism each rank holds part of every sample's tokens: the token sum and
    count are all-reduced over the CP group, so the reported loss is the mean over all tokens, and
    the loss this rank backpropagates is ``cp x local sum / global count`` - the data-parallel
    gradient average over DP x CP divides by cp again, giving exactly the global token mean.

    With multi-token prediction ``output_tensor`` is ``[1 + D, b, s]`` and ``mtp_loss_mask`` the
    shifted masks ``[D, b, s]``: each depth's mean is reported as ``mtp_k loss`` and the loss is
    ``lm loss + mtp_loss_scaling_factor / D x sum of the depths' means``.

    ``per_token`` (``--calculate-per-token-loss``): returns ``(sum of this rank's token losses,
    their count, reported)`` with each reported value ``[sum, count]``, and no CP all-reduce; the
    training step divides the gradients by the global batch's token count
    (:mod:`megatron_lite.training.per_token_loss`). With MTP the depths' sums are added with the
    same ``mtp_loss_scaling_factor / D``.
    """
    losses, masks = output_tensor.float(), loss_mask.unsqueeze(0)
    if mtp_loss_mask is None:
        losses = losses.unsqueeze(0)
    else:
        masks = torch.cat([masks, mtp_loss_mask.float()])
    sums, counts = (losses * masks).sum(dim=(1, 2)), masks.sum(dim=(1, 2))
    if per_token:
        depth = len(sums) - 1
        loss = sums[0] + mtp_loss_scaling_factor / depth * sums[1:].sum() if depth else sums[0]
        pairs = torch.stack([sums.detach(), counts], dim=1)
        names = ["lm loss"] + [f"mtp_{k} loss" for k in range(1, depth + 1)]
        return loss, counts[0], dict(zip(names, pairs))
    if cp_group is None:
        means = sums / counts.clamp(min=1)
        shown = means.detach()
    else:
        totals = torch.stack([sums.detach(), counts.detach()])
        torch.distributed.all_reduce(totals, group=cp_group)
        total_counts = totals[1].clamp(min=1)
        means = sums * torch.distributed.get_world_size(cp_group) / total_counts
        shown = totals[0] / total_counts
    depth = len(means) - 1
    loss = means[0] + mtp_loss_scaling_factor / depth * means[1:].sum() if depth else means[0]
    return loss, {"lm loss": shown[0], **{f"mtp_{k} loss": shown[k] for k in range(1, depth + 1)}}


def forward_step(data_iterator, model):
    state, batch = model.state, next(data_iterator)
    config = getattr(model, "module", model).config
    mtp = config.mtp_num_layers if model.training else None  # evaluation ignores multi-token prediction
    if mtp:  # tokens / labels / loss mask shifted by 1..D, before the context-parallel split
        batch = {**batch, **mtp_targets(batch["tokens"], batch["labels"], batch["loss_mask"], mtp)}
    # context parallelism: this rank's two load-balanced chunks of every sequence (with their positions)
    batch = get_batch_on_this_cp_rank(batch, state.cp_rank, state.cp_size)
    batch = {k: v.to(get_device(), non_blocking=True) for k, v in batch.items()}
    # document ids [b, s] (--reset-attention-mask, --sft-pack-sequences): attention stays inside each document
    output = model(batch["tokens"], batch.get("position_ids"), batch.get("document_ids"), labels=batch["labels"],
                   mtp_tokens=batch.get("mtp_tokens"), mtp_labels=batch.get("mtp_labels"))
    mtp_mask = batch.get("mtp_loss_mask")
    return output, partial(loss_func, batch["loss_mask"].float(), cp_group=state.cp_group,
                           mtp_loss_mask=None if mtp_mask is None else mtp_mask.float(),
                           mtp_loss_scaling_factor=config.mtp_loss_scaling_factor,
                           per_token=config.calculate_per_token_loss)


def token_ids_of(batch) -> tuple:
    """A GPT batch's token ids: the inputs and the labels (a sample's last label is no input)."""
    return batch["tokens"], batch["labels"]


def checked_token_ids(batches, vocab_size: int, data: str, ids_of=token_ids_of):
    """Pass batches through, refusing token ids the tokenizer cannot have produced (checked on the
    CPU before the batch moves to the device, so it costs no device synchronisation). ``data``: the
    run's data flags as errors name them (builder.data_flags); ``ids_of(batch)`` gives the batch's
    token-id tensors (pretrain_bert.py passes its own)."""
    for batch in batches:
        ids = ids_of(batch)
        top, low = max(int(t.max()) for t in ids), min(int(t.min()) for t in ids)
        if low < 0:
            raise DataConfigError(
                f"{data}: negative token id {low}; the data is corrupt or was "
                f"written with a signed dtype by another tool"
            )
        if top >= vocab_size:
            raise DataConfigError(
                f"{data}: token id {top} is outside the tokenizer's vocabulary "
                f"of {vocab_size}; the data was preprocessed with another tokenizer (check --tokenizer-type "
                f"and its files)"
            )
        yield batch


def make_datasets_provider(tokenizer):
    def provider(config: Config, state, consumed_train, consumed_valid):
        t = config.training
        train_samples, valid_samples, _ = train_valid_test_num_samples(
            t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters, t.train_samples, t.valid_samples,
            eval_global_batch_size=t.eval_global_batch_size,
        )
        samples = split_samples(config, train_samples, valid_samples, 0)  # the test split is built apart (below)
        data_config = None
        if config.data.sft:  # chat conversations, padded or packed (megatron_lite/data/sft_dataset.py)
            sft = sft_config_from(config, tokenizer)
            conversations = read_sft_data(sft, tokenizer, say=print_rank_0)  # read once, for the test split too
            train_ds, valid_ds, _ = build_sft_datasets(sft, samples, tokenizer, data=conversations)
            build_test = lambda n: build_sft_datasets(sft, [0, 0, n], tokenizer, data=conversations)[2]  # noqa: E731
        else:
            data_config = dataset_config_from_args(config.flat(), tokenizer)
            train_ds, valid_ds, _ = build_train_valid_test_datasets(data_config, samples, tokenizer)
            build_test = lambda n: build_train_valid_test_datasets(data_config, [0, 0, n], tokenizer)[2]  # noqa: E731
        num_chunks = len(my_layer_ranges(config, state))
        wrap = lambda it: checked_token_ids(it, tokenizer.vocab_size, data_flags(config.flat()))  # noqa: E731
        plain = not (t.full_validation or t.multiple_validation_sets)
        train, valid = chunk_data_iterators(config, state, train_ds, valid_ds if plain else None, consumed_train,
                                            consumed_valid, num_chunks, wrap=wrap)
        if t.multiple_validation_sets:  # each dataset of the validation split on its own
            valid_ds = build_validation_sets(data_config, None if t.full_validation else valid_samples, tokenizer)
        if not plain:
            datasets = valid_ds if t.multiple_validation_sets else [] if valid_ds is None else [valid_ds]
            valid = validation_sets(eval_config(config), state, datasets, consumed_valid, num_chunks, wrap) if datasets else None
        test = None  # the test pass at the end of the run (and of --skip-train), where the data gives a test split
        if t.eval_iters > 0:
            test = test_set(eval_config(config), state, build_test, num_chunks, wrap)  # split by --split, as valid
        return train, valid, test

    return provider


def check_packed_mtp(config: Config) -> None:
    """Multi-token prediction shifts whole samples: with packed documents its targets would cross them."""
    packed = [f for f, on in (("--reset-attention-mask", config.data.reset_attention_mask),
                              ("--sft-pack-sequences", config.data.sft_pack_sequences)) if on]
    if config.model.mtp_num_layers and packed:
        raise ConfigError(f"--mtp-num-layers with {packed[0]} is not built (the shifted MTP targets would cross "
                          "document boundaries); drop one of them")


def check_gpt_flags(config: Config) -> None:
    """pretrain_gpt.py's own refusals (one ConfigError line naming the flag)."""
    check_causal_window(config.model.window_size)
    check_packed_mtp(config)


def main(argv=None):
    config = parse_args(argv, description=__doc__.split("\n\n")[0], checks=check_gpt_flags)
    try:
        tokenizer = build_tokenizer_for(config)
        set_vocab(config, tokenizer)
        return pretrain(config, model_provider, forward_step, make_datasets_provider(tokenizer))
    except (ConfigError, DataFileError, DataConfigError, CheckpointError) as err:
        # every rank exits 2 with the message printed once, also when only this rank saw the error
        exit_with_message(f"error: {err}", 2, rank_local=is_rank_local(err))
    except NonFiniteError as err:
        exit_with_message(f"error: {err}", 1)
    except StopEveryRank as err:  # result validation (exit 16/17), the DP weight-hash check (exit 1)
        exit_with_message(f"error: {err}", err.exit_code)
    except RuntimeError:  # a failed collective: did another rank stop on its own error? then exit as it did
        exit_if_a_peer_stopped()
        raise


if __name__ == "__main__":
    run_script(main)  # then the process groups are ended cleanly, and the exit code is main's
