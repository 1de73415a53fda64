#!/bin/bash
# GPT-3 175B (96 layers, hidden 12288, 96 heads, sequence 2048) on 128 nodes x 8 H100 = 1024 GPUs.
#
#   bash examples/gpt3/train_gpt3_175b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/gpt3/train_gpt3_175b.sh    # validate the flags only
#
# Run it on every node (NODE_RANK, MASTER_ADDR, MASTER_PORT set per node), or adapt
# examples/slurm/train_gpt.sbatch, which sets up the rendezvous and requeueing for you.
#
# Layout, TP 8 x PP 16 x DP 8:
#   - tensor parallel 8 keeps each layer's all-reduces inside one node's NVLink domain;
#   - pipeline parallel 16: 175e9 / (8 x 16) = 1.4e9 parameters per GPU, i.e. 2.7 GB of bf16 weights,
#     5.5 GB of fp32 gradients and, with the distributed optimizer sharding the 12 bytes/parameter of
#     fp32 master weights and Adam moments over DP 8, 2.1 GB more: ~10 GB of model state out of 80 GB;
#   - interleaving (3 layers per virtual stage = 2 chunks per GPU) halves the pipeline bubble;
#   - global batch 1536 (GPT-3's 3.2M tokens) = micro-batch 1 x 192 micro-batches x DP 8, and
#     192 is a multiple of PP 16 as the interleaved schedule requires.
# On fewer GPUs keep TP 8 x PP 16 and shrink DP (NUM_NODES 32 gives DP 2); 128 GPUs (DP 1) is the floor.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-128}

CHECKPOINT_PATH=${1:-checkpoints/gpt3_175b}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/gpt3_175b}
VOCAB_FILE=${3:-data/gpt2-vocab.json}
MERGE_FILE=${4:-data/gpt2-merges.txt}
DATA_PATH=${5:-data/my-gpt3_text_document}

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-dropout 0.0          # no dropout at this scale
    --hidden-dropout 0.0
    --init-method-std 0.006          # ~ sqrt(2 / (5 x hidden))
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --train-iters 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --lr 6.0e-5
    --min-lr 6.0e-6
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --lr-decay-iters 430000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
    --num-layers-per-virtual-pipeline-stage 3
    --sequence-parallel              # shard LayerNorm/dropout activations over the TP group too
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
