"""More mutations for ``tests/mutations.py`` (``tests/mutation_list.py`` holds the format and the
earlier ones): the most likely one-line bug in inference decoding (sampling, seeds, beam search,
the key/value cache and MLA's cached path, prefix caching, lm-eval's rolling loglikelihood), in
fine-tuning (SFT conversations, LoRA dropout / scaling / merge, MTP loss scaling) and in the
profiler and memory-report flags, each with the fastest tests that catch it. "missed at first":
the suite passed with the bug; the test named was added (or strengthened) with the entry."""

from __future__ import annotations

from mutation_list import Mutation  # tests/, the script's folder

MUTATIONS = [
    Mutation("top_p_drops_crossing_token", "top-p: the token whose probability crosses top_p dropped (a top_p "
             "below the best token's probability leaves nothing but it, always)", "megatron_lite/inference/sampling.py",
             "    drop[:, 1:] = drop[:, :-1].clone()  # shift right", "    pass  # shift right",
             ("tests/unit/test_inference_engine.py", "-k", "sampling_rules")),
    Mutation("temperature_ignored", "sampling: the logits not divided by the temperature",
             "megatron_lite/inference/sampling.py", ".values) / params.temperature  # max 0", ".values) / 1.0  # max 0",
             ("tests/unit/test_inference_engine.py", "-k", "temperature or sampling_rules")),
    Mutation("random_seed_ignored", "random_seed: the sampling generator not reseeded (the engine's stream goes on)",
             "megatron_lite/inference/engine.py", "            self.generator.manual_seed(params.random_seed)\n",
             "            pass\n", ("tests/unit/test_inference_engine.py", "-k", "seeded")),
    Mutation("beam_length_penalty_ignored", "beam search: a hypothesis scores its sum, not sum / length ** penalty",
             "megatron_lite/inference/beam.py", "        score = total / length ** self.length_penalty\n",
             "        score = total\n", ("tests/unit/test_beam_search.py", "-k", "exhaustive or hypotheses")),
    Mutation("kv_reorder_last_token_kept", "beam search: the cache reorder leaves each row's last cached token "
             "in place (the new beam attends to another beam's last key)", "megatron_lite/inference/kv_cache.py",
             "cache[:self.sequence_offset, :len(rows)] = cache[:self.sequence_offset, rows]",
             "cache[:self.sequence_offset - 1, :len(rows)] = cache[:self.sequence_offset - 1, rows]",
             ("tests/unit/test_beam_search.py", "-k", "reorder or cached")),
    Mutation("mla_cached_row_mask_dropped", "MLA decode: the cached path drops the paged cache's per-row mask "
             "(a row sees keys past its own length)", "megatron_lite/models/mla.py",
             "mask if attention_mask is None else mask | attention_mask, False", "mask, False",
             ("tests/unit/test_continuous_batching.py", "-k", "mla_mtp")),
    Mutation("prefix_reuse_whole_prompt", "prefix caching: a prompt found cached whole reused to its last token "
             "(nothing left to compute the first logits from)", "megatron_lite/inference/scheduler.py",
             "else min(len(p) for p in a.prompts) - 1", "else min(len(p) for p in a.prompts)",
             ("tests/unit/test_prefix_caching.py",)),
    Mutation("lm_eval_rolling_last_window", "lm-eval loglikelihood_rolling: a long text scores its last window only",
             "megatron_lite/inference/lm_eval_backend.py", "            totals[owner] += logprob\n",
             "            totals[owner] = logprob\n", ("tests/unit/test_lm_eval_backend.py", "-k", "rolling")),
    Mutation("sft_prompt_form_system_dropped", "SFT prompt/response lines: the \"system\" field dropped",
             "megatron_lite/data/sft_conversations.py",
             'system = [{"role": "system", "content": record["system"]}] if "system" in record else []',
             "system = []", ("tests/unit/test_sft_data.py", "-k", "prompt_response")),
    Mutation("lora_dropout_at_eval", "LoRA: the adapters' dropout applied in eval mode (evaluation, inference)",
             "megatron_lite/lora/adapters.py", "        if self.dropout_p == 0 or not self.training:\n",
             "        if self.dropout_p == 0:\n", ("tests/unit/test_lora.py", "-k", "dropout")),
    Mutation("lora_merge_scale_alpha", "LoRA merge: B A added times alpha, not alpha / r",
             "megatron_lite/lora/merge.py", "    scale = alpha / rank\n", "    scale = alpha\n",
             ("tests/unit/test_lora.py", "-k", "merge")),
    Mutation("mtp_scaling_factor_not_passed", "MTP: the training step's loss uses loss_func's default 0.1, not "
             "--mtp-loss-scaling-factor", "pretrain_gpt.py",
             "                           mtp_loss_scaling_factor=config.mtp_loss_scaling_factor,\n", "",
             ("tests/unit/test_pretrain_gpt_batch.py",)),
    Mutation("profile_ranks_ignored", "--profile-ranks: every rank profiles (each writes a trace and tables)",
             "megatron_lite/training/profiler.py",
             "self.enabled = logging.profile and rank in (logging.profile_ranks or [0])",
             "self.enabled = logging.profile", ("tests/e2e/test_profiler.py", "-k", "profile_ranks")),
    Mutation("profile_window_one_more", "--profile-step-end: one iteration past the window recorded",
             "megatron_lite/training/profiler.py", "        if iteration >= self.end:\n",
             "        if iteration > self.end:\n", ("tests/e2e/test_profiler.py", "-k", "writes_a_trace")),
    Mutation("memory_report_collectives_temporaries", "--memory-report: a collective's buffers counted as "
             "temporaries, not communication", "megatron_lite/perf/memory_tracker.py",
             '        if func.namespace == "c10d":  # the buffers', '        if False:  # the buffers',
             ("tests/distributed/test_memory_tracker.py", "-k", "collective")),
    Mutation("lora_expert_targets_ignored", "LoRA: MoE experts get fc1 and fc2 adapters whatever --lora-target-modules",
             "megatron_lite/lora/experts.py", 'fcs = [fc for fc in ("linear_fc1", "linear_fc2") if fc in targets]',
             'fcs = ["linear_fc1", "linear_fc2"]', ("tests/unit/test_lora.py", "-k", "target")),
    Mutation("lora_merge_dtype_fp32", "LoRA merge: a bf16 / fp16 base weight merged into an fp32 tensor",
             "megatron_lite/lora/merge.py", "        merged[base] = (weight.float() + scale * delta).to(weight.dtype)\n",
             "        merged[base] = weight.float() + scale * delta\n", ("tests/unit/test_lora.py", "-k", "merge")),
    Mutation("presence_penalty_counts", "presence_penalty: subtracted once per occurrence (as the frequency penalty)",
             "megatron_lite/inference/sampling.py", "params.presence_penalty * (counts > 0).float()",
             "params.presence_penalty * counts", ("tests/unit/test_openai_penalties.py",)),
    Mutation("beam_first_step_every_row", "beam search: the first step ranks every (equal) row's tokens, so the "
             "beams start as copies of one token", "megatron_lite/inference/beam.py",
             "best = (logp[0] if first else logp.reshape(-1)).topk(count)", "best = logp.reshape(-1).topk(count)",
             ("tests/unit/test_beam_search.py", "-k", "exhaustive")),
    Mutation("sft_assistant_header_trained", "SFT default template: the 'Assistant: ' header trained",
             "megatron_lite/data/chat_template.py",
             'add(DEFAULT_HEADERS["assistant"], False)\n            add(content_text',
             'add(DEFAULT_HEADERS["assistant"], True)\n            add(content_text',
             ("tests/unit/test_sft_data.py", "-k", "default_template")),
    Mutation("contbatch_seeded_shares_generator", "continuous batching: a seeded request reseeds and draws from "
             "the shared generator (its samples depend on the batch)", "megatron_lite/inference/batch_request.py",
             "self.generator = torch.Generator(device=device).manual_seed(p.random_seed)",
             "self.generator = engine.generator.manual_seed(p.random_seed)",
             ("tests/unit/test_continuous_batching.py", "-k", "alone")),
    Mutation("sft_packed_positions_run_on", "SFT packing: position ids run on across conversations (not reset)",
             "megatron_lite/data/sft_dataset.py", "        position[at:at + m] = np.arange(m)\n",
             "        position[at:at + m] = np.arange(at, at + m)\n", ("tests/unit/test_sft_data.py", "-k", "pack")),
    Mutation("sft_next_fit_leaves_room", "SFT packing: a conversation that exactly fills the sample starts the next one",
             "megatron_lite/data/sft_dataset.py", "        if n and used + length > capacity:\n",
             "        if n and used + length >= capacity:\n", ("tests/unit/test_sft_data.py", "-k", "pack")),
    Mutation("cached_positions_from_zero", "decoding with a cache: the new tokens' positions counted from 0 (not "
             "after the cached ones; rotary and learned positions alike)", "megatron_lite/models/language_model.py",
             "        start = inference_context.sequence_offset\n", "        start = 0\n",
             ("tests/unit/test_inference_engine.py", "-k", "cached_decoding")),
    Mutation("lm_eval_continuation_one_early", "lm-eval loglikelihood: the sum taken one token early (the context's "
             "last token in, the continuation's last out)", "megatron_lite/inference/lm_eval_backend.py",
             "(float(sum(result.log_probs[-n:])), all(result.greedy[-n:]))",
             "(float(sum(result.log_probs[-n - 1:-1])), all(result.greedy[-n - 1:-1]))",
             ("tests/unit/test_lm_eval_backend.py", "-k", "bos_adding or cut_on_the_left")),
    Mutation("specdec_mtp_cache_kept_too_far", "speculative decoding: each MTP depth keeps one cache entry more "
             "than its accepted tokens allow (an entry that read a refused draft)", "megatron_lite/inference/mtp_drafter.py",
             "max(frontiers[row], min(n, n + kept - k + 1))", "max(frontiers[row], min(n, n + kept - k + 2))",
             ("tests/unit/test_speculative_decoding.py", "-k", "forced_drafts")),
    Mutation("specdec_main_cache_kept_refused", "speculative decoding: the main model's cache keeps the first refused "
             "draft", "megatron_lite/inference/speculative.py", "            main.lengths[r] = start + kept + 1\n",
             "            main.lengths[r] = min(start + kept + 2, start + len(seq.drafts) + 1)\n",
             ("tests/unit/test_speculative_decoding.py", "-k", "greedy_with_drafts or forced_drafts")),
    Mutation("specdec_accepts_too_often", "speculative sampling: a draft kept with probability min(1, 2p / q)",
             "megatron_lite/inference/speculative.py", "(u * q[rows, d] < p[rows, d])", "(u * q[rows, d] < 2 * p[rows, d])",
             ("tests/unit/test_speculative_decoding.py", "-k", "target_distribution")),
    Mutation("specdec_resample_from_p", "speculative sampling: a refused draft replaced by a draw from p, not from "
             "max(0, p - q)", "megatron_lite/inference/speculative.py",
             "                residual = (p[i] - q[i]).clamp(min=0)\n", "                residual = p[i]\n",
             ("tests/unit/test_speculative_decoding.py", "-k", "target_distribution")),
    Mutation("specdec_emits_past_stop", "speculative decoding: the tokens a step kept after a stop token are "
             "emitted too", "megatron_lite/inference/speculative.py",
             "                self.finish = \"stop\" if token in stops else \"length\"\n                return new[:i + 1]\n",
             "                self.finish = self.finish or (\"stop\" if token in stops else \"length\")\n",
             ("tests/unit/test_speculative_decoding.py", "-k", "stop_token")),
    Mutation("specdec_client_left_ignored", "speculative decoding: a sequence whose streaming client left "
             "decodes on to its end", "megatron_lite/inference/speculative.py",
             "            live = [r for r in live if seqs[r].finish is None and not gone[r]]",
             "            live = [r for r in live if seqs[r].finish is None]",
             ("tests/unit/test_speculative_server.py", "-k", "client_left or client_leaving")),
    Mutation("specdec_batch_one_cache_length", "speculative decoding of a batch: every sequence's main cache cut "
             "back to the first sequence's kept length", "megatron_lite/inference/speculative.py",
             "            main.lengths[r] = start + kept + 1\n",
             "            main.lengths[:] = [start + kept + 1] * len(main.lengths)\n",
             ("tests/unit/test_speculative_decoding.py", "-k", "batch_of_prompts")),
    Mutation("specserve_speculation_batched", "the server with --num-speculative-tokens and continuous batching: "
             "requests speculation serves join the batch (no drafts) instead of running alone with them",
             "megatron_lite/inference/batch_runner.py",
             "            if not drafts and self.batch.covers(prompts, params):",
             "            if self.batch.covers(prompts, params):",
             ("tests/unit/test_speculative_server.py", "-k", "greedy")),
    Mutation("specserve_no_fall_back", "the server with --num-speculative-tokens: a request of two prompts runs the "
             "speculative steps (the first prompt only) instead of falling back to the plain engine",
             "megatron_lite/inference/speculative.py", "        if self.speculates(prompts, params):\n"
             "            return self._speculative_steps", "        if True:\n            return self._speculative_steps",
             ("tests/unit/test_speculative_server.py", "-k", "falls_back")),
    Mutation("specdec_tp_draft_shard", "speculative decoding at TP2: each rank drafts from the logits of its own "
             "vocabulary shard (not all-gathered), so the ranks verify different drafts",
             "megatron_lite/inference/mtp_drafter.py",
             "        logits = _all_gather(logits, -1, engine.state.tp_group)  # every rank drafts alike\n", "",
             ("tests/e2e/test_generate_torchrun.py", "-k", "speculative")),
]
