#!/bin/bash
# Llama-3 8B (32 layers, hidden 4096, 32 heads with 8 key/value groups, SwiGLU 14336, RMSNorm, RoPE
# base 500000, vocabulary 128256, sequence 8192) on 1 node x 8 H100.
#
#   bash examples/llama/train_llama3_8b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_JSON DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/llama/train_llama3_8b.sh    # validate the flags only
#
# TOKENIZER_JSON is the model's tokenizer.json (or the folder holding it), read locally through the
# optional `tokenizers` package; preprocess the corpus with the same --tokenizer-type/--tokenizer-model.
#
# Layout, TP 2 x PP 1 x DP 4:
#   - 8.0e9 parameters / TP 2 = 4e9 per GPU: 8 GB of bf16 weights, 16 GB of fp32 gradients, and the
#     12 bytes/parameter of fp32 master weights and Adam moments sharded over DP 4 (12 GB): ~36 GB;
#   - an 8192-token sequence makes activations the other big item, so sequence parallelism shards
#     the norm/dropout activations over the TP pair and selective recomputation drops the
#     attention-score activations (recomputed in the backward pass);
#   - global batch 128 (1M tokens) = micro-batch 1 x 32 micro-batches x DP 4.
# More nodes grow DP (NUM_NODES 4 gives DP 16, 8 micro-batches).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}

CHECKPOINT_PATH=${1:-checkpoints/llama3_8b}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/llama3_8b}
TOKENIZER_JSON=${3:-data/llama3/tokenizer.json}
DATA_PATH=${4:-data/my-llama3_text_document}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --train-iters 250000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad 1.0
    --bf16
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --recompute-granularity selective
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER_JSON"
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
