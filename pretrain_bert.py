"""Pretrain a BERT model (masked LM + sentence-order prediction) with tensor, sequence, pipeline and data parallelism.

    python pretrain_bert.py --data-path data/sample_text_sentence --tokenizer-type BertWordPieceLowerCase \
        --vocab-file data/bert-vocab.txt ...                                        # one process
    torchrun --standalone --nproc-per-node 4 pretrain_bert.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 ...                                         # four

Flags are Megatron-LM's (``--help`` lists them), plus BERT's own: ``--bert-no-binary-head`` (no
sentence-order head and no token-type embeddings: Megatron builds 2 token types with the head, 0
without; there is no separate flag), ``--mask-prob``, ``--short-seq-prob``. The data must be
sentence-split (``tools/preprocess_data.py --split-sentences``) and tokenized with a WordPiece
vocabulary holding [CLS], [SEP], [MASK] and [PAD].

The loss of a micro-batch is the MLM loss averaged over its masked tokens plus the sentence-order
cross-entropy (unweighted); both are reported (``lm loss``, ``sop loss``) on the console, in
TensorBoard and in validation. The model, data and loop are the shared ones; this file says what is
BERT-specific: the model chunks, one micro-batch's forward and loss, and the datasets.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import CheckpointError
from megatron_lite.config import Config, ConfigError
from megatron_lite.data.builder import (
    DataConfigError,
    build_train_valid_test_datasets,
    data_flags,
    dataset_config_from_args,
    given_data_paths,
    parse_data_path,
    train_valid_test_num_samples,
)
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset
from megatron_lite.data.samplers import chunk_data_iterators
from megatron_lite.device import get_device
from megatron_lite.errors import exit_if_a_peer_stopped, exit_with_message, is_rank_local, run_script
from megatron_lite.models import BertModel, TransformerConfig
from megatron_lite.training.eval_batch import eval_config
from megatron_lite.training.loop import pretrain
from megatron_lite.training.nonfinite import NonFiniteError
from megatron_lite.training.rerun import StopEveryRank
from megatron_lite.training.validation import split_samples, test_set
from pretrain_gpt import build_tokenizer_for, checked_token_ids, my_layer_ranges, set_vocab

MIN_SEQ_LENGTH = 5  # [CLS] A [SEP] B [SEP] with one token in each segment


@dataclass
class BertConfig:
    bert_no_binary_head: bool = False
    """Train without the sentence-order (binary) head and without token-type embeddings."""
    mask_prob: float = 0.15
    """Fraction of a sample's tokens ([CLS]/[SEP] counted, as in Megatron) to predict in the masked-LM task."""
    short_seq_prob: float = 0.1
    """Probability of a sample with a shorter, random target length."""
    bert_load: str | None = None
    """Megatron: a BERT checkpoint for retrieval models (ICT/REALM); not supported here, use --load."""


def check_bert_config(config: Config) -> None:
    """BERT's own flag rules (one ConfigError line naming the flag)."""
    b, seq = config.bert, config.model.seq_length
    for flag, on in (("--full-validation", config.training.full_validation),
                     ("--multiple-validation-sets", config.training.multiple_validation_sets)):
        if on:  # as in Megatron-LM, GPT data only
            raise ConfigError(f"{flag} is built for pretrain_gpt.py's data only (as in Megatron-LM); drop it")
    if b.bert_load is not None:
        raise ConfigError("--bert-load feeds retrieval models (ICT/REALM), which are not implemented; "
                          "to continue BERT pretraining use --load")
    if not 0.0 <= b.mask_prob <= 1.0:  # a fraction; Megatron-LM takes 1 too
        raise ConfigError(f"--mask-prob must be in [0, 1], got {b.mask_prob}")
    if not 0.0 <= b.short_seq_prob <= 1.0:
        raise ConfigError(f"--short-seq-prob must be in [0, 1], got {b.short_seq_prob}")
    if seq < MIN_SEQ_LENGTH:
        raise ConfigError(f"--seq-length {seq} is too short for BERT: [CLS] A [SEP] B [SEP] needs at least "
                          f"{MIN_SEQ_LENGTH}")
    if b.mask_prob == 0 and b.bert_no_binary_head:  # no masked-LM target and no sentence-order head
        raise ConfigError("--mask-prob 0 with --bert-no-binary-head leaves nothing to train (no masked token to "
                          "predict, no sentence-order head): give --mask-prob > 0, or drop --bert-no-binary-head")
    if b.mask_prob > 0 and int(b.mask_prob * (seq - 3)) < 1:  # the cap of every sample's predictions is 0
        need = 3 + next(t for t in range(seq - 2, 10**6) if int(b.mask_prob * t) >= 1)
        raise ConfigError(f"--seq-length {seq} with --mask-prob {b.mask_prob:g} predicts no token (a sample predicts "
                          f"at most int(mask-prob x (seq-length - 3)) = 0), so the masked-LM loss is 0 and trains "
                          f"nothing; use --seq-length >= {need} or a larger --mask-prob")
    if config.training.calculate_per_token_loss:  # BERT's loss adds the per-sample SOP loss to the MLM mean
        raise ConfigError("--calculate-per-token-loss is GPT-only (pretrain_bert.py's MLM + sentence-order loss is "
                          "a per-micro-batch mean); drop the flag")
    if config.parallel.context_parallel_size > 1:  # BERT's batch is not split over CP: an IndexError, not a run
        raise ConfigError("--context-parallel-size > 1 is GPT-only (BERT's bidirectional padding mask is not split "
                          "over context-parallel ranks); use 1, and --tensor-model-parallel-size with "
                          "--sequence-parallel to split long sequences")
    d = config.data  # GPT's end-of-document options: a BERT sample has no EOD token to act on
    eod_flags = [f for f, on in (("--reset-position-ids", d.reset_position_ids),
                                 ("--reset-attention-mask", d.reset_attention_mask),
                                 ("--eod-mask-loss", d.eod_mask_loss)) if on]
    if eod_flags:
        raise ConfigError(f"{' '.join(eod_flags)}: GPT-only (they act on end-of-document tokens; a BERT sample is "
                          "[CLS] A [SEP] B [SEP] of one document, with padding masked already); drop the flag")
    if config.data.mock_data or not (config.data.data_path or config.data.train_data_path):  # before the shared check
        raise ConfigError("pretrain_bert.py needs a sentence-split --data-path (--mock-data is GPT-only)")
    if config.model.mtp_num_layers:
        raise ConfigError("--mtp-num-layers is GPT-only (multi-token prediction of a causal model); drop it")


def check_tokenizer(config: Config, tokenizer) -> None:
    """BERT samples need [CLS], [SEP], [MASK] and [PAD] (WordPiece vocabularies have them)."""
    missing = [name for name in ("cls", "sep", "mask", "pad") if getattr(tokenizer, name, None) is None]
    if missing:
        raise ConfigError(f"--tokenizer-type {config.data.tokenizer_type} has no {'/'.join(missing)} token; "
                          "BERT needs --tokenizer-type BertWordPieceLowerCase (or BertWordPieceCase) --vocab-file, "
                          "or SentencePieceTokenizer --tokenizer-model (it appends them)")


def check_sentence_level(data_path, flag: str = "--data-path") -> None:
    """Refuse document-level data (every document a single sequence) for the binary head's sentence pairs."""
    prefixes, _ = parse_data_path(data_path, flag)
    for prefix in prefixes:
        try:
            ds = IndexedDataset(prefix)
        except DataFileError as err:
            raise DataFileError(f"{flag}: {err}") from None
        if ds.num_documents() > 0 and (np.diff(np.asarray(ds.document_indices)) <= 1).all():
            raise DataConfigError(f"{flag} {prefix} has no document of two or more sequences (document-level "
                                  "data, or every document one sentence or empty); the binary head needs sentence "
                                  "pairs: preprocess with tools/preprocess_data.py --split-sentences (documents of "
                                  "several sentences), or train with --bert-no-binary-head")


def binary_head(config: Config) -> bool:
    return not config.bert.bert_no_binary_head


def model_provider(config: Config, state) -> list[torch.nn.Module]:
    """The model chunks this rank holds: one per virtual pipeline stage (one without interleaving)."""
    model_config = TransformerConfig.from_config(config)
    ranges = my_layer_ranges(config, state)
    head = binary_head(config)
    return [
        BertModel(model_config, state, num_tokentypes=2 if head else 0, add_binary_head=head,
                  pre_process=state.is_first_stage() and i == 0,
                  post_process=state.is_last_stage() and i == len(ranges) - 1, layer_start=start, layer_end=end)
        for i, (start, end) in enumerate(ranges)
    ]


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output):
    """MLM loss averaged over the masked tokens, plus the sentence-order loss with the binary head."""
    lm_losses, binary_logits = output
    lm_loss = (lm_losses.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
    if binary_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    sop_loss = F.cross_entropy(binary_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


def forward_step(with_binary_head: bool, data_iterator, model):
    batch = {k: v.to(get_device(), non_blocking=True) for k, v in next(data_iterator).items()}
    types = batch["types"] if with_binary_head else None
    output = model(batch["text"], batch["padding_mask"], types, lm_labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"].float(), batch["is_random"])


def bert_token_ids(batch) -> tuple:
    """A BERT batch's token ids: the (masked) text and the original ids at the predicted positions
    (labels are -1 elsewhere). Data tokenized with another vocabulary is refused in one line."""
    return batch["text"], batch["labels"].clamp(min=0)


def make_datasets_provider(tokenizer):
    def provider(config: Config, state, consumed_train, consumed_valid):
        t = config.training
        train_samples, valid_samples, _ = train_valid_test_num_samples(
            t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters, t.train_samples, t.valid_samples,
            eval_global_batch_size=t.eval_global_batch_size,
        )
        # config.flat() holds the "bert" section too: --mask-prob, --short-seq-prob, --bert-no-binary-head
        data_config = dataset_config_from_args(config.flat(), tokenizer, bert=True)
        samples = split_samples(config, train_samples, valid_samples, 0)  # --skip-train: no training set
        train_ds, valid_ds, _ = build_train_valid_test_datasets(data_config, samples, tokenizer)
        num_chunks = len(my_layer_ranges(config, state))
        wrap = lambda it: checked_token_ids(it, tokenizer.vocab_size, data_flags(config.flat()),  # noqa: E731
                                            ids_of=bert_token_ids)
        train, valid = chunk_data_iterators(config, state, train_ds, valid_ds, consumed_train, consumed_valid,
                                            num_chunks, wrap=wrap)
        if t.eval_iters == 0:  # no test pass (at the end of the run, or of --skip-train)
            return train, valid
        return train, valid, test_set(eval_config(config), state, lambda n: build_train_valid_test_datasets(
            data_config, [0, 0, n], tokenizer)[2], num_chunks, wrap)

    return provider


def main(argv=None):
    config = parse_args(argv, description=__doc__.split("\n\n")[0], extra_sections={"bert": BertConfig},
                        checks=check_bert_config)
    try:
        tokenizer = build_tokenizer_for(config)
        check_tokenizer(config, tokenizer)
        if binary_head(config):  # without it a document is one segment (Megatron: one sentence is enough)
            for flag, paths in given_data_paths(config.flat()):  # --data-path, or the per-split paths
                check_sentence_level(paths, flag)
        set_vocab(config, tokenizer)
        return pretrain(config, model_provider, partial(forward_step, binary_head(config)),
                        make_datasets_provider(tokenizer))
    except (ConfigError, DataFileError, DataConfigError, CheckpointError) as err:
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
