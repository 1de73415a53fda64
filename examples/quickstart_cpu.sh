#!/usr/bin/env bash
# The README's main command: on a fresh CPU machine, install, build the offline sample corpus,
# train a tokenizer, preprocess, train a tiny GPT with tensor (2) x pipeline (2) parallelism on
# 4 CPU processes (gloo), then generate a sample from the checkpoint.
#
#   bash examples/quickstart_cpu.sh            # ~3 minutes on 2 cores
#   ITERS=50 bash examples/quickstart_cpu.sh   # shorter
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/quickstart}
ITERS=${ITERS:-300}
WARMUP=$(( ITERS / 15 ))  # 20 of the default 300; any ITERS >= 1 runs
mkdir -p "$OUT"

python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -c "import megatron_lite, sentencepiece, tqdm, tensorboard" 2>/dev/null || python3 -m pip install -q -e .

echo "== 1. sample corpus (Python's own documentation, offline)"
python3 tools/make_sample_corpus.py --output "$OUT/corpus.jsonl"
echo "== 2. SentencePiece tokenizer"
python3 tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/spm" --vocab-size 2048
echo "== 3. preprocess to Megatron .bin/.idx"
python3 tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/sample" \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/spm.model" --append-eod --workers 2

echo "== 4. train: tensor-parallel 2 x pipeline-parallel 2 on 4 CPU processes"
rm -rf "$OUT/checkpoints"
OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 --seq-length 128 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1 --clip-grad 1.0 \
    --data-path "$OUT/sample_text_document" --split 98,2,0 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/spm.model" \
    --eval-interval 100 --eval-iters 4 --log-interval 10 \
    --save "$OUT/checkpoints" --save-interval 1000 --tensorboard-dir "$OUT/tensorboard"

echo "== 5. generate from the checkpoint (loaded at TP=1 in one process)"
python3 tools/generate.py --load "$OUT/checkpoints" \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$OUT/spm.model" \
    --prompt "The for statement is used to" --max-new-tokens 40 --temperature 0.8 --top-k 20 --seed 1

echo "== 6. loss curve"
python3 tools/plot_loss.py "$OUT/tensorboard" --output "$OUT/loss.png"
echo "done: checkpoints in $OUT/checkpoints, TensorBoard logs in $OUT/tensorboard, loss curve $OUT/loss.png"
