#!/bin/bash
# BERT-large (24 layers, hidden 1024, 16 heads, sequence 512, lower-cased WordPiece vocabulary)
# on 1 node x 8 H100, with the BERT paper's batch of 256 sequences of 512 tokens.
#
#   bash examples/bert/train_bert_large.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/bert/train_bert_large.sh    # validate the flags only
#
# Needs pretrain_bert.py. DATA_PATH is a corpus preprocessed with --split-sentences into
# <prefix>_text_sentence.bin/.idx, with the same --tokenizer-type and --vocab-file.
#
# Layout, TP 1 x PP 1 x DP 8: 340e6 parameters take ~6 GB with fp32 master weights and Adam
# moments, so every GPU holds the whole model; global batch 256 = micro-batch 32 x 1 x DP 8.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}

CHECKPOINT_PATH=${1:-checkpoints/bert_large}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/bert_large}
VOCAB_FILE=${3:-data/bert-large-uncased-vocab.txt}
DATA_PATH=${4:-data/my-bert_text_sentence}

BERT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
    --attention-dropout 0.1
    --hidden-dropout 0.1
)

TRAINING_ARGS=(
    --micro-batch-size 32
    --global-batch-size 256
    --train-iters 1000000
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16                           # dynamic loss scaling, as in the BERT runs of the Megatron papers
    --lr 1.0e-4
    --min-lr 1.0e-5
    --lr-decay-style linear
    --lr-warmup-iters 10000
    --lr-decay-iters 990000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type BertWordPieceLowerCase
    --vocab-file "$VOCAB_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --exit-signal-handler
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

launch pretrain_bert.py "${BERT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
