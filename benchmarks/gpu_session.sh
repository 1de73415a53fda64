#!/usr/bin/env bash
# Everything to run when a session has one GPU for a few minutes, most important first. Each step
# has its own time limit and a failed step does not stop the next; the logs go to $LOG.
#
#   DATA=outputs/quickstart LOG=outputs/gpu bash benchmarks/gpu_session.sh          # part 1: ~9 minutes at most
#   PART=2 DATA=outputs/quickstart LOG=outputs/gpu bash benchmarks/gpu_session.sh   # part 2, if time is left
#
# A session gets ~15 minutes of device time, the machine's start included, and one command may run 10
# minutes: part 1's limits add up to 560 s, so it fits one call with time to spare.
#
# PACK=FILE.tar re-packs $LOG into FILE after every step (so a run cut short still returns its logs);
# CKPT is where the training steps checkpoint (default $LOG/checkpoints; removed afterwards).
#
# DATA holds sample_text_document.{bin,idx} and spm.model (what examples/quickstart_cpu.sh's steps
# 1-3 write). Part 1: the issue's CPU step targets on the host's CPU (it has bf16 matrix units; the
# CPU the sessions work on has none) and the step's GEMMs alone in each layout; the CUDA path against
# the CPU (benchmarks/cuda_checks.py); one training step ours vs Hugging Face on the GPU (bf16, FP8);
# the quickstart's model trained in bf16 on the GPU, resumed, and sampled. Part 2: profiles of the
# host CPU's and the GPU's bf16 and FP8 steps, --torch-compile and fp32 on the GPU, the compiled run
# against the CPU, --torch-compile on the host CPU, FP8 GEMMs, KV-cache generation, the host step with glibc's defaults.
# benchmarks/gpu_probe.py (seconds) says what the GPU's FP8 and grouped GEMMs accept.
set -u -o pipefail
cd "$(dirname "$0")/.."
LOG=${LOG:-outputs/gpu}
DATA=${DATA:-outputs/quickstart}
CKPT=${CKPT:-$LOG/checkpoints}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log to $LOG/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*" >> "$LOG/steps.log"
    timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
    rc=$?
    echo "   rc $rc in $(( $(date +%s) - start )) s" >> "$LOG/steps.log"
    tail -n 25 "$LOG/$name.log" >> "$LOG/steps.log"
    if [ -n "${PACK:-}" ]; then tar -C "$LOG" -cf "$PACK" .; fi
}

{ date -u; nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
  grep -o -m1 "model name.*" /proc/cpuinfo; grep -o -w "amx_bf16\|avx512_bf16" /proc/cpuinfo | sort -u | tr "\n" " "; echo
} >> "$LOG/steps.log" 2>&1

MODEL=(--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 --seq-length 128
       --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
       --attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 4 --global-batch-size 16 --bf16
       --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0
       --data-path "$DATA/sample_text_document" --split 98,2,0
       --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$DATA/spm.model"
       --eval-interval 100 --eval-iters 4 --log-interval 50 --save "$CKPT" --save-interval 150 --train-iters 300)

if [ "${PART:-1}" = 1 ]; then
  # the issue's CPU targets on this host's CPU (2 threads): ratios paired by round, MFU against the best peak read
  step host_cpu_step 200 python3 benchmarks/bench_step.py --device cpu --threads 2 --dtypes fp32 bf16 fp8 --rounds 5 \
      --warmup 1
  step gemm_layouts 60 python3 benchmarks/bench_gemm_layouts.py --threads 2 --rounds 3
  step cuda_checks 130 python3 benchmarks/cuda_checks.py --only gpt gpt_b gpt_b_bf16 moe moe_bf16 deepseek fp8 fp8_moe
  step bench_step_gpu 70 python3 benchmarks/bench_step.py --device cuda --shape gpu --dtypes bf16 fp8 --rounds 3 --warmup 2
  rm -rf "$CKPT"
  step train_bf16 40 python3 -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py "${MODEL[@]}" \
      --exit-interval 150
  step resume_bf16 40 python3 -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py "${MODEL[@]}" \
      --load "$CKPT"
  step generate 20 python3 tools/generate.py --load "$CKPT" \
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$DATA/spm.model" \
      --prompt "The for statement is used to" --max-new-tokens 40 --temperature 0.8 --top-k 20 --seed 1
  rm -rf "$CKPT"
else
  step host_cpu_profile 80 python3 benchmarks/bench_step.py --device cpu --threads 2 --dtypes bf16 fp8 --no-hf --rounds 1 \
      --warmup 1 --profile
  step profile_gpu 90 python3 benchmarks/bench_step.py --device cuda --shape gpu --dtypes bf16 fp8 --no-hf --rounds 2 \
      --warmup 1 --profile
  step bench_step_gpu_more 150 python3 benchmarks/bench_step.py --device cuda --shape gpu --dtypes bf16 fp32 --compile \
      --rounds 3 --warmup 1
  step cuda_checks_compile 150 python3 benchmarks/cuda_checks.py --only gpt_b_compile
  step bench_fp8 90 python3 benchmarks/bench_fp8.py --issue-config --steps 5
  step bench_generate 90 python3 benchmarks/bench_generate.py --device cuda --rounds 2 --skip-uncached
  # --torch-compile on the host CPU (Inductor's vectorised AVX-512 code around oneDNN's bf16 GEMMs)
  step host_cpu_compile 200 python3 benchmarks/bench_step.py --device cpu --threads 2 --dtypes bf16 --compile \
      --rounds 3 --warmup 2
  # the C library's defaults on both sides (the host-CPU step above keeps freed memory on both sides)
  step host_cpu_step_glibc 150 python3 benchmarks/bench_step.py --device cpu --threads 2 --dtypes bf16 --rounds 3 \
      --warmup 1 --no-retain-host-memory
fi
date -u >> "$LOG/steps.log"
