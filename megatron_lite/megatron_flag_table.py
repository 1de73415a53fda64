"""The table of Megatron-LM training flags that megatron_lite does not take: (flags, why, fix).

Read by :mod:`megatron_lite.megatron_flags`, which refuses each flag with its reason and fix. The names
come from Megatron-LM's ``megatron/training/arguments.py`` and the config dataclasses its newer
versions build flags from (tests/fixtures/megatron_flags.txt lists them, with the commits read), and a
few older aliases its example scripts used. A flag added to our parser must leave this table.
"""

DROP = "drop it"

# (flags, why it is absent, the fix). Several flags share one entry where the reason is the same.
ENTRIES = (
    # -- network size and architecture ------------------------------------------------------------
    ("--encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length",
     "encoder-decoder (T5) models are not built here", "use --num-layers and --seq-length"),
    ("--use-flash-attn", "flash-attn is used whenever it is installed and the inputs allow it", DROP),
    ("--relative-attention-num-buckets --relative-attention-max-distance",
     "relative position embeddings (T5) are not implemented", "use --position-embedding-type rope"),
    ("--use-rotary-position-embeddings", "Megatron-LM's deprecated switch for rotary embeddings",
     "use --position-embedding-type rope"),
    ("--no-position-embedding", "Megatron-LM's deprecated switch; a rope model has no learned position table "
     "anyway", "use --position-embedding-type rope"),
    ("--qk-clip", "QK-clip (shrinking query/key weights after large attention logits) is not implemented", DROP),
    ("--mrope-section", "multimodal rotary embeddings are not implemented", DROP),
    ("--onnx-safe", "ONNX export is not supported", DROP),
    ("--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json",
     "models whose layers differ in shape are not supported", DROP),
    ("--use-legacy-models", "there is one model implementation (Megatron-Core's layout)", DROP),
    ("--padded-vocab-size --no-pad-vocab-size --disable-pad-vocab-size", "the padded vocabulary is derived from the tokenizer and "
     "--make-vocab-size-divisible-by", "use --vocab-size or --make-vocab-size-divisible-by"),
    # -- old names --------------------------------------------------------------------------------
    ("--model-parallel-size", "Megatron-LM's old name", "use --tensor-model-parallel-size"),
    ("--batch-size", "Megatron-LM's old name", "use --micro-batch-size"),
    ("--warmup", "Megatron-LM's old name", "use --lr-warmup-iters or --lr-warmup-fraction"),
    ("--checkpoint-activations", "Megatron-LM's deprecated name",
     "use --recompute-granularity full --recompute-method uniform"),
    ("--checkpoint-num-layers --activations-checkpoint-num-layers", "Megatron-LM's old name",
     "use --recompute-num-layers"),
    ("--activations-checkpoint-method", "Megatron-LM's old name", "use --recompute-method"),
    ("--num-virtual-stages-per-pipeline-rank", "virtual stages are given by layers per stage here",
     "use --num-layers-per-virtual-pipeline-stage"),
    ("--use-dist-ckpt --dist-ckpt-format", "Megatron-LM's deprecated switch", "use --ckpt-format torch_dist"),
    ("--DDP-impl --no-contiguous-buffers-in-local-ddp",
     "Megatron-LM's removed DDP switches; gradients always live in one contiguous fp32 buffer", DROP),
    # -- regularisation and optimizer -------------------------------------------------------------
    ("--use-torch-optimizer-for-cpu-offload --no-pin-cpu-grads --no-pin-cpu-params",
     "the CPU-offloaded optimizer has one implementation", "drop it (--optimizer-cpu-offload stays)"),
    ("--dump-param-to-param-group-map --no-weight-decay-cond-type", "parameter groups are fixed (decay for matrices, none for biases "
     "and norms)", DROP),
    ("--megatron-fsdp-main-params-dtype --megatron-fsdp-main-grads-dtype "
     "--no-preserve-fp32-weights --disable-preserve-fp32-weights",
     "main gradients and master weights are always fp32 (Megatron-FSDP is not built)", DROP),
    # -- learning rate ----------------------------------------------------------------------------
    ("--step-batch-size-schedule", "the global batch changes only by --rampup-batch-size's linear ramp",
     "use --rampup-batch-size"),
    # -- training loop ----------------------------------------------------------------------------
    ("--check-for-nan-in-grad", "Megatron-LM's data-parallel wrapper option (each rank's gradients checked for "
     "NaN/inf, which Megatron-LM's training sets from --check-for-nan-in-loss-and-grad) is not a flag of its own here",
     "drop it (--check-for-nan-in-loss-and-grad, on by default, checks each rank's loss and gradient norm)"),
    ("--variable-seq-lengths", "every micro-batch is --seq-length tokens", DROP),
    ("--enable-autocast", "the forward runs in the weights' dtype (--bf16 / --fp16), not under torch.autocast",
     DROP),
    ("--num-microbatches-with-partial-activation-checkpoints", "recomputation is the same for every micro-batch",
     "use --recompute-num-layers"),
    ("--distribute-saved-activations", "recomputation keeps a layer's input whole on every tensor-parallel "
     "rank", DROP),
    ("--cpu-offloading-num-layers", "activation offloading to the CPU is not implemented",
     "use --recompute-granularity full"),
    ("--no-clone-scatter-output-in-embedding", "the embedding output handling is fixed", DROP),
    ("--disable-gloo-process-groups", "the process groups a run makes are fixed", DROP),
    ("--record-memory-history --memory-snapshot-path", "CUDA memory snapshots are not written",
     "use --memory-report"),
    ("--gpu-sniff-test-interval", "GPU performance sniff tests are not run", DROP),
    ("--exit-signal-handler-for-dataloader --exit-signal-handler-for-training", "the signal handling is fixed: "
     "--exit-signal-handler saves a checkpoint and exits on SIGTERM", "drop it (--exit-signal-handler stays)"),
    ("--disable-manual-gc-eval", "newer Megatron-LM's second spelling of --no-manual-gc-eval",
     "use --no-manual-gc-eval"),
    ("--disable-log-loss-scale-to-tensorboard", "newer Megatron-LM's second spelling of "
     "--no-log-loss-scale-to-tensorboard", "use --no-log-loss-scale-to-tensorboard"),
    ("--disable-jit-fuser", "fused functions run as --jit-fuser says", "use --jit-fuser eager"),
    ("--train-sync-interval", "the CPU waits for the device at the step's own synchronisation points", DROP),
    ("--test-mode", "Megatron-LM's in-run test hooks are not implemented", DROP),
    ("--adlr-autoresume --adlr-autoresume-interval", "ADLR cluster autoresume is not supported",
     "use --exit-signal-handler or --exit-duration-in-mins"),
    ("--yaml-cfg --enable-experimental", "flags come from the command line only", DROP),
    # -- tensor-parallel communication overlap (Transformer Engine userbuffers) ----------------------
    ("--tp-comm-overlap --tp-comm-overlap-cfg --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs "
     "--tp-comm-overlap-rs-dgrad --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad "
     "--tp-comm-bootstrap-backend --disable-tp-comm-split-ag --disable-tp-comm-split-rs --tp-comm-overlap-disable-qkv "
     "--tp-comm-overlap-disable-fc1 --tp-comm-atomic-ag --tp-comm-atomic-rs",
     "overlapping tensor-parallel communication with GEMMs needs Transformer Engine userbuffers, "
     "which are not used", DROP),
    ("--no-async-tensor-model-parallel-allreduce", "Megatron-LM ignores it too", DROP),
    # -- distributed ------------------------------------------------------------------------------
    ("--microbatch-group-size-per-virtual-pipeline-stage --no-overlap-p2p-communication "
     "--overlap-p2p-communication-warmup-flush --no-scatter-gather-tensors-in-pipeline --use-ring-exchange-p2p "
     "--pipeline-model-parallel-comm-backend", "the pipeline schedule's communication is fixed", DROP),
    ("--distributed-timeout-seconds-after-init", "process-group timeouts are not set per phase", DROP),
    ("--defer-embedding-wgrad-compute --wgrad-deferral-limit --delay-wgrad-compute "
     "--overlap-dispatch-backward-with-experts-wgrad",
     "weight gradients are computed in each backward (--pipeline-schedule zb-h1 splits them its own way)",
     DROP),
    ("--no-align-grad-reduce --disable-align-grad-reduce --no-align-param-gather --align-param-gather --overlap-param-gather-with-optimizer-step",
     "the timing of the data-parallel collectives is fixed", "drop it (--overlap-grad-reduce and "
     "--overlap-param-gather stay)"),
    ("--ddp-num-buckets", "buckets are sized, not counted", "use --ddp-bucket-size"),
    ("--bucket-size", "the bucket size is --ddp-bucket-size's", "use --ddp-bucket-size"),
    ("--ddp-pad-buckets-for-high-nccl-busbw --no-gradient-reduce-div-fusion --ddp-average-in-collective "
     "--pad-buckets-for-high-nccl-busbw --disable-gradient-reduce-div-fusion --average-in-collective",
     "bucket padding and gradient averaging are fixed", DROP),
    ("--grad-reduce-in-bf16",
     "gradients are always reduced in fp32 (--grad-reduce-in-fp32 is accepted)", DROP),
    ("--local-rank --lazy-mpu-init", "ranks come from the launcher's environment (RANK, LOCAL_RANK, "
     "WORLD_SIZE)", "drop it and launch with torchrun"),
    ("--use-nccl-ub --nccl-ub --fsdp-manual-registration --disable-symmetric-registration --use-sharp --sharp-enabled-group "
     "--nccl-communicator-config-path --high-priority-stream-groups",
     "NCCL user buffers, SHARP and communicator tuning are not used", DROP),
    ("--init-model-with-meta-device", "weights are made on the CPU and copied to this rank's device", DROP),
    ("--fsdp-double-buffer --suggested-communication-unit-size --keep-fp8-transpose-cache",
     "Megatron-FSDP's tuning knobs do not apply to the built-in sharding", "use --data-parallel-sharding-strategy"),
    ("--enable-full-sharding-in-hsdp --outer-dp-sharding-strategy", "hybrid sharding here keeps every sharded state inside one instance "
     "(replicated across instances), never sharded across them", "use --num-distributed-optimizer-instances N "
     "with the strategy, or N = 1 to shard over all data-parallel ranks"),
    ("--hybrid-context-parallel --dynamic-context-parallel --max-seqlen-per-dp-cp-rank", "sequences are not "
     "regrouped by length over the data- and context-parallel ranks; every sample is --seq-length tokens split "
     "over --context-parallel-size ranks", "use --context-parallel-size and --seq-length"),
    ("--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward", "PyTorch FSDP2 is not used",
     "use --data-parallel-sharding-strategy optim_grads_params"),
    ("--use-tp-pp-dp-mapping", "the rank order is fixed (tp-cp-ep-dp-pp)", DROP),
    ("--replication --replication-jump --replication-factor", "local checkpoint replication is not "
     "implemented", DROP),
    # -- mixed precision --------------------------------------------------------------------------
    ("--fp16-lm-cross-entropy", "the cross-entropy is always computed in fp32", DROP),
    ("--disable-bf16-reduced-precision-matmul", "PyTorch's matmul precision settings are left as they are",
     DROP),
    ("--reuse-grad-buf-for-mxfp8-param-ag", "parameters are not kept or gathered in FP8 (MXFP8 included)", DROP),
    # -- Transformer Engine, FP8 and FP4 ----------------------------------------------------------
    ("--fp8-param-gather", "FP8 weights are cast from the 16-bit ones at each GEMM; parameters are not "
     "kept or gathered in FP8", DROP),
    ("--fp8-interval", "deprecated in Megatron-LM, which ignores it", DROP),
    ("--fp8-dot-product-attention --fp8-multi-head-attention", "attention (its softmax and the score and "
     "value products) runs in bf16; FP8 covers the linear layers' GEMMs", DROP),
    ("--tp-only-amax-red", "delayed scaling reduces amaxes over the tensor-parallel group and the data-parallel "
     "replicas (context parallelism included) every step, so all replicas share one scale", DROP),
    ("--fp8-quantizer-factory --fp4-format --fp4-recipe --fp4-quantizer-factory --fp4-param-gather",
     "custom quantizers and FP4 are not implemented", "drop it (FP8: --fp8-format)"),
    ("--te-rng-tracker --inference-rng-tracker --use-te-activation-func",
     "Transformer Engine's RNG tracker and activation kernels are not used", DROP),
    ("--kitchen-config-file --kitchen-recipe-number", "NVIDIA Kitchen quantization is not supported", DROP),
    # -- checkpointing ----------------------------------------------------------------------------
    ("--most-recent-k", "keeping only the k most recent checkpoints is not implemented",
     "use --save-retain-interval (or --non-persistent-save-interval)"),
    ("--non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo",
     "local non-persistent checkpoints (node-local storage through NVIDIA's resiliency package) are not written",
     "use --non-persistent-ckpt-type global with --non-persistent-save-interval"),
    ("--save-params-interval --save-activations-interval --save-tokens-per-expert-interval --save-wgrads-interval "
     "--save-dgrads-interval", "debugging dumps of tensors are not written", DROP),
    ("--no-save-tokenizer-assets --disable-save-tokenizer-assets --verify-integrity", "what a checkpoint holds "
     "and how it is checked are fixed", DROP),
    ("--load-main-params-from-ckpt", "fp32 master weights are loaded with the optimizer state", DROP),
    ("--no-strict-fsdp-dtensor-load --disable-strict-fsdp-dtensor-load --dist-ckpt-strictness "
     "--no-ckpt-load-validate-sharding-integrity --disable-ckpt-load-validate-sharding-integrity", "a checkpoint's tensors must match the model's "
     "exactly", DROP),
    ("--use-mp-args-from-checkpoint-args --no-use-tokenizer-model-from-checkpoint-args "
     "--disable-use-tokenizer-model-from-checkpoint-args",
     "--use-checkpoint-args takes the model flags only", DROP),
    ("--use-persistent-ckpt-worker --async-strategy --async-ckpt-cpu-priority --async-ckpt-io-priority "
     "--async-ckpt-use-cpu-shm", "--async-save writes from a background thread of its own", DROP),
    ("--ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format",
     "checkpoints are converted by a tool", "use tools/checkpoint/convert.py"),
    ("--ckpt-fully-parallel-save --ckpt-fully-parallel-save-process-group "
     "--ckpt-fully-parallel-save-replicate-local", "torch_dist weights are written by "
     "data-parallel rank 0 (optimizer shards by every rank with --use-distributed-optimizer), not spread over "
     "the data-parallel ranks", DROP),
    ("--ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-process-group "
     "--ckpt-fully-parallel-load-replicate-local", "every rank reads the pieces it needs itself; reads are not spread over "
     "the data-parallel ranks and exchanged", DROP),
    ("--ckpt-assume-constant-structure --dist-ckpt-save-pre-mcore-014 --distrib-optim-fully-reshardable-mem-efficient",
     "the torch_dist layout is fixed (and always reshardable over TP, PP and DP)", DROP),
    # -- data and tokenizer -----------------------------------------------------------------------
    ("--data-args-path --per-split-data-args-path", "the blends are read from the command line only",
     "use --data-path (or --train-data-path, --valid-data-path, --test-data-path) with the blend itself"),
    ("--no-create-attention-mask-in-dataloader", "the loaders make only the masks a model needs (none for "
     "GPT's causal attention)", DROP),
    ("--num-dataset-builder-threads --object-storage-cache-path --s3-cache-path --mid-level-dataset-surplus "
     "--allow-ambiguous-pad-tokens --sample-rate", "the dataset builder's options are fixed", DROP),
    ("--vocab-extra-ids", "extra sentinel tokens (T5) are not added", DROP),
    ("--tokenizer-metadata --legacy-tokenizer --special-tokens --tokenizer-special-tokens "
     "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
     "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
     "Megatron-LM's new tokenizer system (megatron.core.tokenizers) is not supported",
     "use the --tokenizer-type tokenizers (TikTokenizer: --tiktoken-special-tokens; HuggingFaceTokenizer: the "
     "tokenizer.json's own special tokens)"),
    ("--trust-remote-code", "Hugging Face tokenizers with custom code are not loaded", DROP),
    ("--tokenizer-hf-no-use-fast",
     "HuggingFaceTokenizer always reads tokenizer.json with the tokenizers package (the fast tokenizer)", DROP),
    ("--sft-tokenizer-prompt-format --tokenizer-prompt-format", "--sft applies the tokenizer's own chat template", DROP),
    # -- logging ----------------------------------------------------------------------------------
    ("--log-energy --no-barrier-with-level-1-timing --timing-log-option --logging-level "
     "--log-throughput-to-tensorboard --throughput-window-size --log-memory-interval --log-device-memory-used "
     "--log-l2-norm-grad-to-tensorboard --log-max-attention-logit --log-runtime-to-tensorboard --runtime-time-unit "
     "--no-filter-warnings --disable-filter-warnings --modules-to-filter --set-level-for-all-loggers",
     "these logging options are fixed", "drop it (--timing-log-level stays)"),
    ("--wandb-entity", "Weights & Biases runs go to the default entity", "drop it, or set WANDB_ENTITY"),
    ("--run-workload-inspector-server", "the workload inspector is not implemented", DROP),
    ("--one-logger-project --one-logger-run-name --one-logger-async --app-tag-run-name "
     "--app-tag-run-version", "NVIDIA's one-logger is not used", DROP),
    ("--enable-ft-package --calc-ft-timeouts", "NVIDIA's fault-tolerance package is not used", DROP),
    ("--inprocess-restart --inprocess-max-iterations --inprocess-monitor-thread-interval "
     "--inprocess-monitor-process-interval --inprocess-progress-watchdog-interval --inprocess-heartbeat-interval "
     "--inprocess-soft-timeout --inprocess-hard-timeout --inprocess-heartbeat-timeout --inprocess-barrier-timeout "
     "--inprocess-completion-timeout --inprocess-last-call-wait --inprocess-termination-grace-time "
     "--inprocess-granularity --inprocess-active-world-size --inprocess-empty-cuda-cache",
     "in-process restart is not implemented", "drop it (resume from --save with --load)"),
    ("--config-logger-dir --save-config-filepath", "the run's configuration is stored in every checkpoint", DROP),
    ("--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra "
     "--record-shapes --nvtx-ranges", "the profilers' recording options are fixed",
     "drop it (--profile and --use-pytorch-profiler stay)"),
    ("--flight-recorder-dump-path --flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout "
     "--disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace "
     "--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active "
     "--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec",
     "NCCL's flight recorder is not configured by flags", "drop it, or set PyTorch's TORCH_NCCL_* and TORCH_FR_* "
     "environment variables"),
    # -- mixture of experts -----------------------------------------------------------------------
    ("--moe-deepep-num-sms", "DeepEP is not used", DROP),
    ("--ep-overlap-early-attn-memory-release", "expert-parallel communication is not overlapped with other "
     "micro-batches' compute", DROP),
    ("--moe-routing-trace-path --moe-routing-trace-max-training-iters --moe-routing-trace-capture-logits "
     "--moe-routing-trace-capture-hidden-states --moe-routing-trace-dump-weights", "router decisions are not traced to files", DROP),
    ("--moe-flex-dispatcher-backend --moe-hybridep-num-sms", "the flex dispatcher (DeepEP / HybridEP kernels) is "
     "not built", "drop it (--moe-token-dispatcher-type alltoall or allgather)"),
    ("--mla-down-proj-fusion", "MLA's down-projections are plain linear layers (no fused Transformer Engine "
     "kernel)", DROP),
    ("--moe-pad-experts-for-cuda-graph-inference", "CUDA graphs are not used", DROP),
    # -- inference and CUDA graphs ----------------------------------------------------------------
    ("--inference-batch-times-seqlen-threshold --max-tokens-to-oom --flash-decode --use-legacy-static-engine "
     "--inference-max-requests --inference-max-seq-length --inference-max-batch-size --inference-dynamic-batching "
     "--inference-dynamic-batching-buffer-size-gb --inference-dynamic-batching-block-size "
     "--inference-dynamic-batching-buffer-guaranteed-fraction --inference-dynamic-batching-buffer-overflow-factor "
     "--inference-dynamic-batching-max-requests-override --inference-dynamic-batching-max-tokens-override "
     "--inference-dynamic-batching-num-cuda-graphs --inference-dynamic-batching-track-paused-request-events "
     "--inference-dynamic-batching-unified-memory-level --symmetric-ar-type --nccl-all-reduce-for-prefill "
     "--mlp-chunks-for-prefill --disable-chunked-prefill --inference-wandb-logging-step-interval "
     "--cache-mla-latents", "inference has its own tools, not training flags",
     "use tools/generate.py or tools/run_text_generation_server.py"),
    ("--enable-cuda-graph --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl --cuda-graph-scope "
     "--decode-only-cuda-graphs", "CUDA graphs are not used", "drop it (--torch-compile compiles the layers)"),
    ("--output-bert-embeddings --bert-embedder-type", "BERT embedding export is not implemented", DROP),
    # -- models that are not built: retrieval, vision, RL ----------------------------------
    ("--retro-project-dir --retro-add-retriever --retro-cyclic-train-iters --retro-encoder-layers "
     "--retro-encoder-hidden-dropout --retro-encoder-attention-dropout --retro-num-neighbors "
     "--retro-num-retrieved-chunks --retro-attention-gate --retro-no-verify-neighbor-count",
     "Retro is not implemented", DROP),
    ("--ict-head-size --biencoder-projection-dim --biencoder-shared-query-context-model --ict-load "
     "--titles-data-path --query-in-block-prob --use-one-sent-docs --evidence-data-path "
     "--retriever-report-topk-accuracies --retriever-score-scaling --block-data-path --embedding-path "
     "--indexer-batch-size --indexer-log-interval --retriever-seq-length",
     "retrieval models (ICT, REALM, biencoders) are not implemented", DROP),
    ("--num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction --data-per-class-fraction "
     "--no-data-sharding --head-lr-mult --vision-pretraining --vision-pretraining-type --vision-backbone-type "
     "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
     "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer "
     "--dino-norm-last-layer --dino-warmup-teacher-temp --dino-teacher-temp --dino-warmup-teacher-temp-epochs",
     "vision models are not implemented", DROP),
    ("--perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --grpo-iterations "
     "--grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight "
     "--grpo-filter-groups-with-same-reward --grpo-default-temperature --grpo-default-top-p "
     "--langrl-inference-server-type --langrl-inference-server-conversation-template --langrl-external-server "
     "--no-langrl-external-server --langrl-env-config --rl-offload-optimizer-during-inference "
     "--rl-offload-kv-cache-during-training --no-rl-offload-kv-cache-during-training "
     "--rl-remove-kv-cache-during-training --no-rl-remove-kv-cache-during-training --rl-reset-cuda-graphs "
     "--no-rl-reset-cuda-graphs --rl-partial-rollouts --no-rl-partial-rollouts "
     "--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction "
     "--rl-importance-sampling-truncation-coef --rl-calculate-intra-group-similarity "
     "--no-rl-calculate-intra-group-similarity --rl-use-sequence-packing --rl-sequence-packing-bin-size "
     "--rl-sequence-packing-algo", "reinforcement learning (GRPO) is not implemented", DROP),
)
