#!/bin/bash
# DeepSeek-V3 671B (37B active): 61 layers, hidden 7168, 128 heads with multi-latent attention
# (q / kv latent ranks 1536 / 512, qk head 128 + rotary 64, value head 128, YaRN factor 40),
# 256 routed SwiGLU experts of 2048 (top-8, 8 groups / top-4 groups, sigmoid router with expert bias)
# plus one shared expert, the first 3 layers dense (18432), multi-token prediction depth 1,
# vocabulary 129280, sequence 4096, on 128 nodes x 8 H100 (1024 GPUs).
#
#   bash examples/deepseek_v3/train_deepseek_v3_671b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH TOKENIZER_JSON DATA_PATH
#   MEGATRON_LITE_CHECK_ARGS=1 bash examples/deepseek_v3/train_deepseek_v3_671b.sh    # validate the flags only
#
# See docs/deepseek-v3.md for what each MLA / YaRN / MTP flag does. Layout TP 2 (+ SP) x PP 16 x DP 32,
# the 256 experts of each MoE layer over EP 32 (8 per GPU, a subgroup of DP), whole experts per rank
# (--expert-tensor-parallel-size 1):
#   - 61 layers = 3 on the first stage (embedding + the dense layers) + 14 x 4 + 2 on the last stage,
#     which also holds the MTP layer (an MLA + MoE layer), the output layer and a copy of the word
#     embedding (shared with the first stage: MTP embeds the next tokens);
#   - global batch 15360 sequences (63M tokens, DeepSeek-V3's final batch size) = micro-batch 1 x
#     480 micro-batches x DP 32.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch_common.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-128}

CHECKPOINT_PATH=${1:-checkpoints/deepseek_v3_671b}
TENSORBOARD_LOGS_PATH=${2:-tensorboard/deepseek_v3_671b}
TOKENIZER_JSON=${3:-data/deepseek_v3/tokenizer.json}
DATA_PATH=${4:-data/my-deepseek_text_document}

MODEL_ARGS=(
    --num-layers 61
    --hidden-size 7168
    --ffn-hidden-size 18432
    --num-attention-heads 128
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --make-vocab-size-divisible-by 3232
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MLA_ARGS=(
    --multi-latent-attention
    --q-lora-rank 1536
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --qk-layernorm
    --rope-type yarn
    --rotary-base 10000
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    --original-max-position-embeddings 4096
    --beta-fast 32
    --beta-slow 1
)

MOE_ARGS=(
    --num-experts 256
    --moe-layer-freq "([0]*3+[1]*58)"
    --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048
    --moe-router-topk 8
    --moe-router-num-groups 8
    --moe-router-group-topk 4
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

MTP_ARGS=(
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 15360
    --train-iters 250000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --lr 2.2e-4
    --min-lr 2.2e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --recompute-granularity selective
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 16
    --decoder-first-pipeline-num-layers 3
    --decoder-last-pipeline-num-layers 2
    --expert-model-parallel-size 32
    --expert-tensor-parallel-size 1
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
    --ckpt-format torch_dist
    --exit-signal-handler
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

launch pretrain_gpt.py "${MODEL_ARGS[@]}" "${MLA_ARGS[@]}" "${MOE_ARGS[@]}" "${MTP_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}"
