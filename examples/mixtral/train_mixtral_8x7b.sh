#!/bin/bash
# Mixtral 8x7B (32 layers, hidden 4096, 32 heads with 8 key/value groups, 8 SwiGLU experts of 14336
# with top-2 routing, RMSNorm, RoPE base 1e6, vocabulary 32000, sequence 4096) on 8 nodes x 8 H100.
#
#   bash examples/mixtral/train_mixtral_8x7b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_MODEL DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/mixtral/train_mixtral_8x7b.sh    # validate the flags only
#
# TOKENIZER_MODEL is the model's SentencePiece tokenizer.model, read by GPTSentencePieceTokenizer (its
# 32000 pieces, </s> between documents; SentencePieceTokenizer would append <CLS> <SEP> <EOD> <MASK>
# <PAD>); preprocess the corpus with the same --tokenizer-type/--tokenizer-model.
#
# The mixture-of-experts flags are Megatron-LM's (--num-experts, --moe-router-topk, --moe-grouped-gemm,
# --expert-model-parallel-size, ...; docs/mixture-of-experts.md).
#
# Layout, TP 1 x PP 4 x DP 16, with the 8 experts of each layer spread over EP 8 (a subgroup of DP):
#   - 46.7e9 parameters, 45e9 of them in experts. Per GPU: 1/4 of the layers (PP 4), 1 expert of 8
#     in each of them (EP 8): 45e9 / 32 + 1.6e9 / 4 = 1.8e9 parameters, ~22 GB of weights,
#     gradients and optimizer state with the distributed optimizer;
#   - expert parallelism turns the expert all-reduce into two all-to-alls per layer inside a node;
#   - global batch 256 (1M tokens) = micro-batch 1 x 16 micro-batches x DP 16.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-8}

CHECKPOINT_PATH=${1:-checkpoints/mixtral_8x7b}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/mixtral_8x7b}
TOKENIZER_MODEL=${3:-data/mixtral/tokenizer.model}
DATA_PATH=${4:-data/my-mixtral_text_document}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 4096
    --max-position-embeddings 32768
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall     # the two all-to-alls per layer the header describes
    --moe-grouped-gemm
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --train-iters 250000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad 1.0
    --bf16
    --lr 1.0e-4
    --min-lr 1.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --recompute-granularity selective
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --use-distributed-optimizer
    --overlap-grad-reduce
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type GPTSentencePieceTokenizer    # the model's 32000 pieces; </s> ends documents
    --tokenizer-model "$TOKENIZER_MODEL"
    --split 99,1,0
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --exit-signal-handler
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
