"""More mutations for ``tests/mutations.py`` (``tests/mutation_list.py`` holds the format and the
earlier ones): the most likely one-line bug in each behaviour added on 2026-11-29 (per-split data
paths, --split strictness, resume data sizing, the aux-loss names exchange, --spec / MLA agreement,
HF importers' sizes, the lost-peer save wording, HF export staging, the server's hostile inputs,
merge_datasets' multimodal modes, the resume notes and the --exit-duration-in-mins clock; TikTokenizer's id
offset and Llama2Tokenizer's BOS), each with the
merge_datasets' multimodal modes, the resume notes and the --exit-duration-in-mins clock; the init,
warmup-init and eval-batch flags; interleaved zero bubble's memory bound and sync switch), each with the
fastest tests that catch it."""

from __future__ import annotations

from mutation_list import Mutation  # tests/, the script's folder

MUTATIONS = [
    Mutation("per_split_valid_reads_train", "--valid-data-path / --test-data-path: every split reads --train-data-path",
             "megatron_lite/data/builder.py", "for name, paths in zip(SPLIT_NAMES, per_split):",
             "for name, paths in zip(SPLIT_NAMES, [per_split[0]] * 3):",
             ("tests/unit/test_per_split_data_paths.py", "-k", "own_dataset or weighted_blend")),
    Mutation("per_split_tokenizer_names_data_path", "--train-data-path without --tokenizer-type: the line names "
             "--data-path (missed at first)", "megatron_lite/config_checks.py",
             "f\"{(per_split or ['--data-path'])[0]} needs --tokenizer-type", "f\"{'--data-path'} needs --tokenizer-type",
             ("tests/unit/test_per_split_data_paths.py", "-k", "missing_tokenizer")),
    Mutation("split_field_as_zero", "--split '98,2,x': a field that is not a number read as 0",
             "megatron_lite/data/builder.py", "    except ValueError:\n        return None\n",
             "    except ValueError:\n        return 0.0\n", ("tests/unit/test_data_builder.py", "-k", "split")),
    Mutation("resume_data_not_resized", "resume at a smaller --global-batch-size: the training set not built for "
             "the samples the rest of the run reads", "megatron_lite/training/batch_rampup.py",
             "    if needed <= t.train_iters * t.global_batch_size:\n", "    if True:\n",
             ("tests/unit/test_batch_rampup.py", "-k", "resume")),
    Mutation("train_samples_end_from_start", "--train-samples resumed at another batch: iterations counted from "
             "the start (reads past the samples)", "megatron_lite/training/batch_rampup.py",
             "t.train_iters = iteration + max(0, t.train_samples - consumed) // t.global_batch_size",
             "t.train_iters = t.train_samples // t.global_batch_size",
             ("tests/unit/test_batch_rampup.py", "-k", "resume")),
    Mutation("plugin_names_not_kept", "--spec aux losses: the exchanged names not kept (all_gather_object every step)",
             "megatron_lite/moe/metrics.py", "names = _PLUGIN_NAMES[chunks[0]] = _all_names(local | set(names))",
             "names = _all_names(local | set(names))", ("tests/unit/test_plugin_loss_values.py",)),
    Mutation("zb_h1_compiled_gemms_traced", "--torch-compile with --pipeline-schedule zb-h1: the deferrable GEMMs "
             "traced into the layer graph (their backward fixed to compute dW at once: nothing deferred to W)",
             "megatron_lite/parallel/pipeline/wgrad.py", "        if torch.compiler.is_compiling():\n",
             "        if False:\n", ("tests/e2e/test_torch_compile.py", "-k", "zero_bubble")),
    Mutation("fp8_history_not_restored", "a torch_dist resume starts every FP8 amax history afresh (missed while the "
             "resume test used most_recent, which reads only the latest row)", "megatron_lite/checkpoint/dist.py",
             "    fresh = {t.name for t in tensors if (fresh_fp8 and is_fp8_state_key(t.name))",
             "    fresh = {t.name for t in tensors if (t.name.endswith('amax_history'))",
             ("tests/e2e/test_resume_exactness.py", "-k", "fp8_delayed")),
    Mutation("spec_mla_flag_stock_layer", "--multi-latent-attention with a --spec layer of stock attention: taken",
             "megatron_lite/models/spec_plugin.py", "    if model.multi_latent_attention and not all(is_mla):\n",
             "    if False:\n", ("tests/unit/test_spec_flag_agreement.py", "-k", "latent")),
    Mutation("hf_size_not_required", "HF import: a config.json without a size (heads, head_dim, experts) imported",
             "megatron_lite/checkpoint/hf_defaults.py", "            raise KeyError(field)\n", "            pass\n",
             ("tests/unit/test_hf_defaults.py", "-k", "size_config_json_leaves_out")),
    Mutation("save_lost_renaming_as_renamed", "peer lost in a save's final step: rank 0 says the checkpoint is the "
             "latest before it renamed it", "megatron_lite/checkpoint/save_lost.py", "    if progress.renamed:\n",
             "    if progress.renaming:\n", ("tests/unit/test_save_lost_peer.py",)),
    # missed at first (test added with the entry):
    Mutation("save_lost_rank0_unsure", "peer lost in the final step before rank 0's rename: rank 0 unsure "
             "whether it renamed", "megatron_lite/checkpoint/save_lost.py", "    elif progress.renaming and rank != 0:\n",
             "    elif progress.renaming:\n", ("tests/unit/test_save_lost_peer.py", "-k", "rank_0")),
    Mutation("save_lost_tmp_note_always", "lost-peer line: '(the next save removes <tmp>)' for a folder not there",
             "megatron_lite/checkpoint/save_lost.py", ' if os.path.isdir(tmp) else "")', ")",
             ("tests/unit/test_save_lost_peer.py", "-k", "rank_0")),
    Mutation("hf_export_staged_beside", "HF export into an existing --save-dir: staged beside it (another disk "
             "than a mount point), not inside", "megatron_lite/files.py",
             'tmp = os.path.join(path, f"{STAGED}.tmp.{os.getpid()}")', 'tmp = f"{path}.tmp.{os.getpid()}"',
             ("tests/unit/test_hf_export_staging.py",)),
    Mutation("hf_export_config_first", "HF export into an existing --save-dir: config.json moved in before the "
             "weights (missed at first)", "megatron_lite/files.py", "key=lambda n: (n in last, n)",
             "key=lambda n: (n not in last, n)", ("tests/unit/test_hf_export_staging.py", "-k", "replaced_folder")),
    Mutation("server_no_client_timeout", "server: a client that sends nothing holds the connection for ever",
             "megatron_lite/inference/server.py", "        timeout = CLIENT_TIMEOUT_S", "        timeout = None",
             ("tests/unit/test_server_hostile.py", "-k", "stalled")),
    Mutation("request_nan_taken", "request number fields: NaN / Infinity pass the range checks",
             "megatron_lite/inference/fields.py", "    if not math.isfinite(value):  # JSON's", "    if False:  # JSON's",
             ("tests/unit/test_openai_fields.py", "tests/unit/test_api_megatron_fields.py", "-k", "nan or finite")),
    Mutation("openai_eod_text_shown", "OpenAI answers (not streamed): the end-of-document token's text shown",
             "megatron_lite/inference/detokenize.py",
             'return continuation_text(tokenizer, without_end(result, getattr(tokenizer, "eod", None)))',
             "return continuation_text(tokenizer, result)", ("tests/unit/test_openai_end_of_document.py",)),
    Mutation("openai_stream_eod_text_shown", "OpenAI answers streamed: the end-of-document token's text sent",
             "megatron_lite/inference/api_stream.py", "TextStream(tokenizer, p, job.stops, quiet_end=True)",
             "TextStream(tokenizer, p, job.stops, quiet_end=False)", ("tests/unit/test_openai_end_of_document.py",)),
    Mutation("merge_modes_dropped", "merge_datasets: the inputs' multimodal sequence modes not carried",
             "megatron_lite/data/indexed_dataset.py", "            self.sequence_modes.extend(other.sequence_modes.tolist())\n",
             "            pass\n", ("tests/unit/test_merge_datasets.py", "-k", "modes")),
    Mutation("exit_duration_from_first_step", "--exit-duration-in-mins counted from the first step (start-up and "
             "checkpoint load left out)", "megatron_lite/training/loop.py",
             "self.start = time.time() if started is None else started", "self.start = time.time()",
             ("tests/e2e/test_resume_exactness.py", "-k", "start_up")),
    Mutation("resume_layout_note_silent", "a resume at another layout or micro-batch size: no note that it is not "
             "bit for bit", "megatron_lite/checkpoint/resume_notes.py",
             "    if all((now.get(key) or 1) == (value or 1) for key, value in saved.items()):\n", "    if True:\n",
             ("tests/unit/test_resume_notes.py",)),
    # checkpoint management (feat/ckptmgmt)
    Mutation("retention_deletes_tracked", "--save-retain-interval / non-persistent: the tracker's iteration deleted "
             "when older than the save", "megatron_lite/checkpoint/retention.py",
             "if iteration >= latest or iteration == tracked or", "if iteration >= latest or",
             ("tests/unit/test_checkpoint_management.py", "-k", "own_layout")),
    Mutation("retention_follows_links", "retention: a symbolic link named iter_N deleted",
             "megatron_lite/checkpoint/retention.py", "if match is None or os.path.islink(path) or",
             "if match is None or", ("tests/unit/test_checkpoint_management.py", "-k", "own_layout")),
    Mutation("non_persistent_never_loaded", "--non-persistent-ckpt-type global: --load ignores a newer non-persistent "
             "checkpoint", "megatron_lite/checkpoint/load_source.py",
             "    if np_iteration is None or np_iteration == \"release\":",
             "    if True:", ("tests/unit/test_checkpoint_management.py", "-k", "newer")),
    Mutation("upcycle_fc2_unscaled", "--moe-use-upcycling: the experts' fc2 weights not scaled by G / m",
             "megatron_lite/moe/upcycling.py", 'dense["fc2.weight"][:, rows] * (g / mass)', 'dense["fc2.weight"][:, rows]',
             ("tests/unit/test_upcycling.py", "-k", "weighted_experts")),
    Mutation("upcycle_fc2_bias_unscaled", "--moe-use-upcycling: the experts' fc2 bias not scaled by 1 / m",
             "megatron_lite/moe/upcycling.py", 'out["fc2.bias"] = dense["fc2.bias"] / mass',
             'out["fc2.bias"] = dense["fc2.bias"]', ("tests/unit/test_upcycling.py", "-k", "weighted_experts")),
    Mutation("upcycle_router_rows_not_shared", "--moe-upcycling-granularity > 1: the experts of one dense copy keep "
             "their own router rows (top-k no longer picks whole copies)", "megatron_lite/moe/upcycling.py",
             "    if granularity == 1:\n        return\n", "    if True:\n        return\n",
             ("tests/unit/test_upcycling.py", "-k", "router_rows")),
    Mutation("layout_stages_contiguous", "--pipeline-model-parallel-layout: a rank given consecutive stages instead of "
             "every pp-th (virtual stage s on rank s // vp, not s % pp)", "megatron_lite/parallel/pipeline/layout.py",
             "        out[s % pp].append((start, start + count))\n", "        out[s // vp].append((start, start + count))\n",
             ("tests/unit/test_pipeline_layout.py", "-k", "valid_layouts")),
    Mutation("account_embedding_slot_ignored", "--account-for-embedding-in-pipeline-split: the embedding's slot not "
             "taken from the first stage's layers", "megatron_lite/parallel/pipeline/partition.py",
             "min(max(slot - embedding, 0), num_layers)", "min(max(slot, 0), num_layers)",
             ("tests/unit/test_pipeline_layout.py", "-k", "account")),
    Mutation("softmax_fp32_ignored", "--attention-softmax-in-fp32: the unfused scores left 16-bit for the softmax",
             "megatron_lite/models/attention.py", "        scores = scores.float() if coeff == 1 else scores.float() * coeff\n",
             "        scores = scores if coeff == 1 else scores.float() * coeff\n",
             ("tests/unit/test_attention_numerics.py", "-k", "dtype_follows")),
    Mutation("qk_layer_scaling_not_undone", "--apply-query-key-layer-scaling: the scores divided by the layer number "
             "and not multiplied back in the fp32 softmax", "megatron_lite/models/attention.py",
             "scores.float() * coeff\n", "scores.float()\n", ("tests/unit/test_attention_numerics.py", "-k", "layer_scaling")),
    Mutation("fp32_residual_embedding_not_cast", "--fp32-residual-connection: the embedding's output left in the "
             "model's dtype (the stream stays 16-bit)", "megatron_lite/models/embedding.py",
             "            hidden = hidden.float()\n", "            pass\n", ("tests/unit/test_fp32_residual.py",)),
    Mutation("fp32_residual_p2p_dtype", "--fp32-residual-connection: the pipeline's p2p buffers in the model's dtype",
             "megatron_lite/training/step.py", "dtype=config.precision.residual_dtype,",
             "dtype=config.precision.params_dtype,", ("tests/unit/test_fp32_residual.py", "-k", "pipeline")),
    Mutation("rerun_data_not_replayed", "--rerun-mode validate_results: the rerun reads the next micro-batches "
             "instead of the step's", "megatron_lite/training/rerun.py", "    def rewind(self) -> None:\n        self.pos = 0\n",
             "    def rewind(self) -> None:\n        self.pos = None\n", ("tests/e2e/test_rerun.py", "-k", "correct_result")),
    Mutation("rerun_rng_not_restored", "--rerun-mode validate_results: the rerun draws new dropout masks",
             "megatron_lite/training/rerun.py", "        set_rng_states(self.saved_rng, self.rng_tracker)\n",
             "        pass\n", ("tests/e2e/test_rerun.py", "-k", "correct_result")),
    Mutation("rotary_interleaved_as_halves", "--rotary-interleaved: the pairs rotated the other way (sin's sign on "
             "the wrong half)", "megatron_lite/models/common.py",
             "[even * cos - odd * sin, odd * cos + even * sin]", "[even * cos + odd * sin, odd * cos - even * sin]",
             ("tests/unit/test_attention_flags.py", "-k", "interleaved")),
    Mutation("output_gate_no_sigmoid", "--attention-output-gate: the gate heads multiplied in without the sigmoid",
             "megatron_lite/models/attention.py", "torch.sigmoid(gate.reshape(context.shape).float())",
             "gate.reshape(context.shape).float()", ("tests/unit/test_attention_flags.py", "-k", "output_gate")),
    Mutation("no_rope_freq_ignored", "--no-rope-freq: a NoPE layer still rotates its queries and keys",
             "megatron_lite/models/attention.py", "if rotary is not None and not self.skips_rope:",
             "if rotary is not None:", ("tests/unit/test_attention_flags.py", "-k", "no_rope")),
    Mutation("tiktoken_ranks_not_offset", "TikTokenizer: the file's ranks not moved past the special tokens (rank 0 "
             "on <unk>'s id)", "megatron_lite/data/tiktoken_tokenizer.py",
             "ranks = {t: r + num for t, r in", "ranks = {t: r for t, r in",
             ("tests/unit/test_tiktoken_tokenizer.py", "-k", "offset")),
    Mutation("llama2_no_bos", "Llama2Tokenizer: no BOS before the text (GPTSentencePieceTokenizer's ids)",
             "megatron_lite/data/tokenizers.py", "return [self.bos] * bos + ids + [self.eos] * (eos and",
             "return [] + ids + [self.eos] * (eos and", ("tests/unit/test_tiktoken_tokenizer.py", "-k", "llama2")),
    Mutation("post_ln_residual_ignored", "--apply-residual-connection-post-layernorm: the residual still the norm's "
             "input", "megatron_lite/models/transformer.py",
             "self.residual_post_norm = config.apply_residual_connection_post_layernorm", "self.residual_post_norm = False",
             ("tests/unit/test_residual_post_layernorm.py", "-k", "adds_the_norms_output")),
    Mutation("post_ln_residual_not_fp32", "--apply-residual-connection-post-layernorm with --fp32-residual-connection: "
             "the norm's 16-bit output added as it is (the stream drops to 16 bits)", "megatron_lite/models/transformer.py",
             "self._residual(out, in_dtype(normed, hidden.dtype))", "self._residual(out, normed)",
             ("tests/unit/test_residual_post_layernorm.py", "-k", "fp32")),
    Mutation("muon_nesterov_ignored", "--muon-use-nesterov: the update is the momentum buffer, not G + m (M - G)",
             "megatron_lite/optim/muon.py", 'u = grad.lerp(buf, m) if group["muon_nesterov"] else buf', "u = buf",
             ("tests/unit/test_muon.py", "-k", "by_hand")),
    Mutation("muon_gram_not_reduced", "--muon-tp-mode distributed: X X^T left per rank (not all-reduced over TP)",
             "megatron_lite/optim/muon.py", "            dist.all_reduce(A, group=group)\n", "            pass\n",
             ("tests/distributed/test_muon.py",)),
    Mutation("muon_qkv_not_split", "Muon: the fused QKV weight orthogonalised whole (as --muon-no-split-qkv)",
             "megatron_lite/optim/muon.py", "        if info.qkv is None:\n", "        if True:\n",
             ("tests/unit/test_muon.py", "-k", "qkv")),
    Mutation("rerun_exit16_rng_not_restored", "exit 16's checkpoint keeps the rerun's generator states, not the "
             "step's: the restarted job's rerun draws other dropout masks", "megatron_lite/training/rerun_resume.py",
             "        set_rng_states(validator.saved_rng, validator.rng_tracker)", "        pass",
             ("tests/e2e/test_rerun.py", "-k", "tracker_skips")),
    Mutation("rerun_source_rank_not_attributed", "a NaN loss on one DP rank counts every replica (whose reduced "
             "gradients it reaches) as failed: all must move for the rerun after exit 16, and the tracker never skips",
             "megatron_lite/training/rerun.py", "failed = (loss_bad if any_loss_bad else fatal) or", "failed = fatal or",
             ("tests/e2e/test_rerun.py", "-k", "dp2_only")),
    Mutation("warmup_init_ignored", "--lr-warmup-init: the warmup still starts from 0",
             "megatron_lite/optim/lr_scheduler.py",
             "return self.warmup_init + (max_lr - self.warmup_init) * n / self.warmup_steps",
             "return max_lr * n / self.warmup_steps", ("tests/unit/test_lr_scheduler.py", "-k", "warmup_init")),
    Mutation("eval_micro_batches_of_training", "--eval-global-batch-size: validation still runs the training "
             "global batch's micro-batch count", "megatron_lite/training/loop.py",
             "evaluate(self.eval_config, self.eval_comm, self.chunks, self.forward_step_func, sets)",
             "evaluate(self.config, self.comm, self.chunks, self.forward_step_func, sets)",
             ("tests/unit/test_eval_batch.py", "-k", "same_samples")),
    Mutation("start_eval_ignored", "--start-eval-at-iter: validation passes before it",
             "megatron_lite/training/eval_batch.py", "(start is None or iteration >= start)", "True",
             ("tests/unit/test_eval_batch.py", "-k", "start_eval")),
    Mutation("xavier_scaled_outputs_normal", "--init-method-xavier-uniform: the output projections keep the "
             "depth-scaled normal init", "megatron_lite/models/transformer_config.py",
             "        if self.init_method_xavier_uniform:\n            return xavier_uniform_init(gen)\n",
             "        if self.init_method_xavier_uniform and not scaled:\n            return xavier_uniform_init(gen)\n",
             ("tests/unit/test_init_flags.py", "-k", "xavier")),
    Mutation("embedding_std_ignored", "--embedding-init-method-std: the embeddings keep --init-method-std",
             "megatron_lite/models/transformer_config.py",
             "std = self.init_method_std if self.embedding_init_method_std is None else self.embedding_init_method_std",
             "std = self.init_method_std", ("tests/unit/test_init_flags.py", "-k", "embedding_std")),
    Mutation("dp_random_init_no_broadcast", "--data-parallel-random-init: the first replica's weights not broadcast",
             "megatron_lite/training/dp_random_init.py", "                if dist.get_world_size(group) > 1:\n",
             "                if False:\n", ("tests/e2e/test_dp_random_init.py", "-k", "first_ones")),
    Mutation("straggler_rank_order", "--log-straggler: ranks ordered by rank number, not by compute time per iteration",
             "megatron_lite/training/straggler.py", "key=lambda r: (per_iter[r], r))", "key=lambda r: r)",
             ("tests/unit/test_straggler.py", "-k", "slow_rank or count_ranks")),
    Mutation("zb_interleaved_no_memory_bound", "interleaved zero bubble: W passes held back past interleaved 1F1B's "
             "first-rank peak (no W forced before an F at the bound)", "megatron_lite/parallel/pipeline/order.py",
             'if not (kind == "F" and live[r] >= bound and pending[r]) and ready:', "if ready:",
             ("tests/unit/test_zero_bubble_interleaved.py", "-k", "memory_bound")),
    Mutation("zb_interleaved_sync_on_early", "interleaved zero bubble, one no_sync factory: the reduction switched on "
             "at chunk 1's last W, before chunk 0's", "megatron_lite/parallel/pipeline/microbatch.py",
             "        if microbatch == self.m - 1 and (self.per_chunk or chunk == 0):\n            self.enable_sync(chunk if",
             "        if microbatch == self.m - 1:\n            self.enable_sync(chunk if",
             ("tests/distributed/test_zero_bubble.py", "-k", "interleaved_zero_bubble_matches")),
    Mutation("merge_reads_every_stage", "--pretrained-checkpoint / upcycling: every pipeline stage's files read, "
             "not only the stages holding a wanted tensor", "megatron_lite/checkpoint/merge.py",
             "        if not picked:\n            continue", "        if False:\n            continue",
             ("tests/unit/test_pretrained_rank_part.py", "-k", "only_its_stage")),
    Mutation("merge_experts_renumbered_by_kept", "a filtered merge: local experts numbered by the kept ones, not the "
             "saved experts per EP rank", "megatron_lite/checkpoint/merge.py",
             "per_rank=None if keep is None else per_rank)", "per_rank=None)",
             ("tests/unit/test_pretrained_rank_part.py", "-k", "kept_experts")),
    Mutation("precision_adam_no_rounding", "--use-precision-aware-optimizer: the moments kept in fp32 after the step "
             "(never rounded to bf16)", "megatron_lite/optim/precision_adam.py",
             "                    if key not in state or state[key].dtype == dtype:",
             "                    if True:", ("tests/unit/test_precision_aware_optimizer.py",)),
    Mutation("precision_adam_chunk_groups", "--use-precision-aware-optimizer: a chunk steps with the first group's "
             "hyper-parameters (weight decay on the biases)", "megatron_lite/optim/precision_adam.py",
             "                    chunk.append(dict(group, params=params))\n                yield chunk",
             "                    chunk.append(dict(groups[0], params=params))\n                yield chunk",
             ("tests/unit/test_precision_aware_optimizer.py",)),
    Mutation("precision_adam_load_fp32", "--use-precision-aware-optimizer: the distributed optimizer loads the "
             "moments in fp32 (as the masters), not in their dtype", "megatron_lite/optim/distrib_optimizer.py",
             "                    dtype = self.moment_dtypes.get(k, piece.master.dtype)  # cast: fp32 <-> bf16 moments",
             "                    dtype = piece.master.dtype",
             ("tests/distributed/test_distrib_optimizer.py", "-k", "precision_aware")),
    Mutation("precision_adam_dist_load_fp32", "--use-precision-aware-optimizer: torch_dist loads the moments into "
             "fp32 tensors", "megatron_lite/checkpoint/dist.py",
             'dtype=getattr(optimizer, "moment_dtypes", {}).get(k, master.dtype))', "dtype=master.dtype)",
             ("tests/e2e/test_sharded_data_parallel.py", "-k", "bf16_moments")),
    Mutation("sft_no_test_split", "--sft: no test split built, so the run's end-of-training test pass is skipped",
             "pretrain_gpt.py", "build_sft_datasets(sft, [0, 0, n], tokenizer, data=conversations)[2]", "None",
             ("tests/e2e/test_sft.py", "-k", "test_split_pass")),
    Mutation("lora_compile_first_layer_twice", "--torch-compile with LoRA: the frozen embedding's output enters the "
             "first compiled layer without requires_grad, so Dynamo compiles that layer a second time",
             "megatron_lite/models/transformer.py", "if torch.is_grad_enabled() and not hidden.requires_grad:",
             "if False:", ("tests/unit/test_lora.py", "-k", "compiled_layers")),
    Mutation("api_segments_token_alone", "PUT /api: each segment decoded from its token alone (U+FFFD for a "
             "character split over tokens)", "megatron_lite/inference/api_megatron.py",
             '"segments": [token_segments(tokenizer, r) for r in results],',
             '"segments": [[tokenizer.detokenize([t]) for t in r.tokens] for r in results],',
             ("tests/unit/test_api_megatron_fields.py", "-k", "segments"), count=2),
]
