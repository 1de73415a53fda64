#!/usr/bin/env bash
# BERT pretraining on one node of 8 GPUs: tensor-parallel 2 (with sequence parallelism) x
# pipeline-parallel 2 x data-parallel 2, bf16, distributed optimizer. A BERT-base shape
# (12 layers, hidden 768, 12 heads) at sequence length 512.
#
# The data must be sentence-split WordPiece data:
#   python tools/train_tokenizer.py --input corpus.jsonl --output-prefix data/bert --model-type wordpiece --vocab-size 30522
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --tokenizer-type BertWordPieceLowerCase --vocab-file data/bert-vocab.txt --split-sentences --workers 16
#
#   DATA=data/corpus_text_sentence VOCAB=data/bert-vocab.txt bash examples/pretrain_bert_distributed.sh
# More nodes: NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash examples/pretrain_bert_distributed.sh (and
# NODE_RANK=1 on the second node); the data-parallel size grows with the number of GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "$(basename "$0"): error: NODE_RANK $NODE_RANK is not a node of NNODES $NNODES; set NNODES to the number" \
         "of nodes (the same on every node) and NODE_RANK to 0..NNODES-1" >&2
    exit 2
fi
RDZV=(--master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-6000}")
if [ "$NNODES" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then RDZV=(--standalone); fi  # one node: a free port
DATA=${DATA:-data/corpus_text_sentence}
VOCAB=${VOCAB:-data/bert-vocab.txt}
CHECKPOINTS=${CHECKPOINTS:-checkpoints/bert_base}

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" "${RDZV[@]}" pretrain_bert.py \
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
    --use-distributed-optimizer --overlap-grad-reduce --bf16 \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size 8 --global-batch-size 256 --train-iters 1000000 \
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-warmup-iters 10000 --weight-decay 0.01 --clip-grad 1.0 \
    --mask-prob 0.15 --short-seq-prob 0.1 \
    --data-path "$DATA" --split 949,50,1 --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    --num-workers 2 --log-interval 100 --eval-interval 1000 --eval-iters 10 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" --save-interval 10000 --tensorboard-dir "$CHECKPOINTS/tensorboard"
