#!/bin/bash
# GPT-3 XL size, 1.3B (24 layers, hidden 2048, 16 heads, sequence 2048) on 1 node x 8 H100.
#
#   bash examples/gpt3/train_gpt3_1.3b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/gpt3/train_gpt3_1.3b.sh    # validate the flags only
#
# Layout, TP 1 x PP 1 x DP 8: the whole model fits on one GPU. 1.3e9 parameters take 2.6 GB of bf16
# weights, 5.2 GB of fp32 gradients and 15.6 GB of fp32 master weights and Adam moments (2 GB per
# GPU once the distributed optimizer shards them over DP 8), so model parallelism would only add
# communication; pure data parallelism is fastest.
# Global batch 512 (GPT-3's 1M tokens) = micro-batch 4 x 16 micro-batches x DP 8. More nodes only
# grow DP: NUM_NODES up to 16 (DP 128, micro-batch 4 x 1) keeps the global batch; beyond that lower
# --micro-batch-size or raise --global-batch-size.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}

CHECKPOINT_PATH=${1:-checkpoints/gpt3_1.3b}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/gpt3_1.3b}
VOCAB_FILE=${3:-data/gpt2-vocab.json}
MERGE_FILE=${4:-data/gpt2-merges.txt}
DATA_PATH=${5:-data/my-gpt3_text_document}

GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-dropout 0.0          # no dropout at this scale
    --hidden-dropout 0.0
    --init-method-std 0.014          # ~ sqrt(2 / (5 x hidden))
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 512
    --train-iters 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --lr 2.0e-4
    --min-lr 2.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --lr-decay-iters 430000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --use-distributed-optimizer      # shard fp32 master weights and Adam moments over DP
    --overlap-grad-reduce
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type GPT2BPETokenizer
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --log-throughput
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --exit-signal-handler            # SIGTERM (preemption): save, then exit 0
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

launch pretrain_gpt.py "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
