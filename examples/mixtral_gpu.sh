#!/usr/bin/env bash
# A Mixtral-style mixture-of-experts GPT on one node of 8 GPUs: 8 experts, top-2 routing, SwiGLU,
# GQA, RoPE, RMSNorm; expert parallelism 4 x tensor parallelism 2 (+ sequence parallelism), so the
# data-parallel size is 4 and each EP rank holds 2 experts. The default shape is a reduced one that
# fits 80 GB cards; MIXTRAL_FULL=1 uses Mixtral 8x7B's (32 layers, hidden 4096, expert FFN 14336),
# which needs more GPUs (raise PP). Data: a Megatron .bin/.idx prefix and its SentencePiece model.
#
#   DATA=/data/corpus_text_document TOKENIZER=/data/spm.model bash examples/mixtral_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?set DATA to the .bin/.idx prefix}" "${TOKENIZER:?set TOKENIZER to the SentencePiece .model}"
GPUS=${GPUS:-8}
if [[ "${MIXTRAL_FULL:-0}" == 1 ]]; then
    SHAPE=(--num-layers 32 --hidden-size 4096 --moe-ffn-hidden-size 14336 --ffn-hidden-size 14336
           --num-attention-heads 32 --num-query-groups 8 --seq-length 4096)
else
    SHAPE=(--num-layers 8 --hidden-size 2048 --moe-ffn-hidden-size 5632 --ffn-hidden-size 5632
           --num-attention-heads 16 --num-query-groups 4 --seq-length 2048)
fi

torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py \
    "${SHAPE[@]}" --group-query-attention --max-position-embeddings 32768 \
    --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 \
    --expert-model-parallel-size 4 --tensor-model-parallel-size 2 --sequence-parallel \
    --use-distributed-optimizer --overlap-grad-reduce --bf16 \
    --micro-batch-size 1 --global-batch-size 256 --train-iters "${ITERS:-10000}" \
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0 \
    --attention-dropout 0 --hidden-dropout 0 --init-method-std 0.01 \
    --data-path "$DATA" --split 99,1,0 --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --log-interval 10 --log-throughput --eval-interval 500 --eval-iters 10 \
    --save "${SAVE:-checkpoints/mixtral}" --save-interval 1000 --tensorboard-dir "${TB:-runs/mixtral}"
