#!/bin/bash
# Llama-3 70B (80 layers, hidden 8192, 64 heads with 8 key/value groups, SwiGLU 28672, RMSNorm, RoPE
# base 500000, vocabulary 128256, sequence 8192) on 8 nodes x 8 H100 = 64 GPUs.
#
#   bash examples/llama/train_llama3_70b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_JSON DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/llama/train_llama3_70b.sh    # validate the flags only
#
# Run it on every node (NODE_RANK, MASTER_ADDR, MASTER_PORT set per node), or adapt
# examples/slurm/train_gpt.sbatch, which sets up the rendezvous and requeueing for you.
#
# Layout, TP 8 x PP 4 x DP 2:
#   - tensor parallel 8 inside a node (NVLink); pipeline parallel 4 across nodes;
#   - 70.6e9 / (8 x 4) = 2.2e9 parameters per GPU: 4.4 GB of bf16 weights, 8.8 GB of fp32 gradients
#     and 13 GB of optimizer state (12 bytes/parameter sharded over DP 2): ~26 GB before activations;
#   - 5 layers per virtual stage = 4 chunks per GPU shrinks the pipeline bubble 4x;
#   - global batch 512 (4M tokens) = micro-batch 1 x 256 micro-batches x DP 2 (a multiple of PP 4).
# Scaling: keep TP 8 x PP 4 (32 GPUs is the floor) and add nodes for DP; at 1024 GPUs (DP 32)
# 16 micro-batches per step still keep the bubble small.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-8}

CHECKPOINT_PATH=${1:-checkpoints/llama3_70b}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/llama3_70b}
TOKENIZER_JSON=${3:-data/llama3/tokenizer.json}
DATA_PATH=${4:-data/my-llama3_text_document}

MODEL_ARGS=(
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
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
    --global-batch-size 512
    --train-iters 250000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --clip-grad 1.0
    --bf16
    --lr 1.5e-4
    --min-lr 1.5e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --recompute-granularity selective
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 4
    --num-layers-per-virtual-pipeline-stage 5
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
