#!/usr/bin/env python3
"""Mutation probe: break one line of the library at a time and check that the suite notices.

Each mutation below is a bug the suite once missed or caught only late (issue 26, and the sweep of
the parallel core, MoE routing, LR schedule, resume, MLA/MTP and SFT masks that followed), or a
guard of a reduction the parallel core depends on. For each one this script copies the repository
to a scratch folder, applies the one edit there (the text to replace must occur exactly ``count``
times), runs the tests named for it with the scratch copy first on ``PYTHONPATH`` and reports
``caught`` (some test failed), ``missed`` (all passed) or ``error`` (the tests could not run:
collection error, the edit no longer applies). The first assertion line of each failing test is
printed, so "caught at step 1" can be read off it.

Not part of the pytest run (the file name does not start with ``test_``)::

    python tests/mutations.py                 # every mutation
    python tests/mutations.py zb_h1 cp_scale  # some of them
    python tests/mutations.py --control       # also run the tests unmutated (they must pass)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY = ["megatron_lite", "tests", "tools", "pretrain_gpt.py", "pretrain_bert.py", "pyproject.toml"]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    count: int = 1


MUTATIONS = [
    Mutation("fp8_tp_amax", "FP8: the amax MAX-reduce over each gemm's (tensor-parallel) group dropped",
             "megatron_lite/precision/fp8.py",
             "        _all_reduce_max_rows(latest, rows, delayed[rows[0]].amax_group)\n",
             "        pass\n",
             ("tests/distributed/test_fp8.py",)),
    Mutation("fp8_mxfp8_dgrad_weight", "FP8 mxfp8: dgrad's weight blocked along the input features (the forward's way)",
             "megatron_lite/precision/fp8_block.py",
             "        wq, w_dgrad = _rows(weight, size, name, E4M3), _cols(weight, size, name, E4M3)",
             "        wq = w_dgrad = _rows(weight, size, name, E4M3)",
             ("tests/unit/test_fp8_block.py",)),
    Mutation("moe_aux_counts", "MoE: the TP x CP sum of the aux-loss token counts dropped",
             "megatron_lite/moe/router.py",
             "        counts = _sum_over(aux_map.sum(dim=0).float(), group)\n",
             "        counts = aux_map.sum(dim=0).float()\n",
             ("tests/distributed/test_moe_grads.py",)),
    Mutation("moe_router_tp_only", "MoE: router reductions over TP only instead of TP x CP",
             "megatron_lite/moe/router.py", 'self.state.group("tp_cp")', "self.state.tp_group",
             ("tests/e2e/test_pretrain_moe.py", "-k", "cp2"), count=4),
    Mutation("zero_grad_scale", "ZeRO-2/3: sharded-gradient buckets skip the 1/dp scaling",
             "megatron_lite/parallel/grad_bucket.py",
             "        if self.scale != 1.0:\n",
             "        if self.scale != 1.0 and self.grad_shard is None:\n",
             ("tests/distributed/test_zero_grads.py",)),
    Mutation("cp_grad_scale", "CP: gradients scaled 1/dp instead of 1/(dp x cp)",
             "megatron_lite/parallel/data_parallel.py",
             "scale = 1.0 / (self.state.dp_size * self.state.cp_size)",
             "scale = 1.0 / self.state.dp_size",
             ("tests/e2e/test_pretrain_gpt_cp.py::test_context_parallel_runs_reproduce_single_process[cp2-2-A-extra0]",)),
    Mutation("ring_causal", "ring attention: the causal blocks of earlier and later ranks swapped",
             "megatron_lite/parallel/ring_attention.py",
             "    if source < rank:\n", "    if source > rank:\n",
             ("tests/distributed/test_context_parallel.py",)),
    Mutation("hcp_groups_swapped", "a2a+p2p: all-to-all over the ring groups and the ring over the all-to-all groups",
             "megatron_lite/parallel/context.py",
             'self.a2a_group, self.ring_group = state.group("cp_a2a"), state.group("cp_ring")',
             'self.ring_group, self.a2a_group = state.group("cp_a2a"), state.group("cp_ring")',
             ("tests/distributed/test_context_parallel.py", "-k", "hierarchical")),
    Mutation("ckpt_crc", "checkpoint CRC never verified",
             "megatron_lite/checkpoint/format.py",
             "    if saved is None:  # written before checksums existed\n",
             "    if True:  # mutated: never verify\n",
             ("tests/unit/test_checkpoint_damage.py",)),
    Mutation("hf_gate_up", "HF Llama: gate/up swapped in both export and import",
             "megatron_lite/checkpoint/hf.py",
             "            gate, up = sd[src + FC1 + kind].chunk(2, dim=0)\n",
             "            up, gate = sd[src + FC1 + kind].chunk(2, dim=0)\n",
             ("tests/distributed/test_convert.py", "-k", "hf")),
    Mutation("hf_gate_up_import", "(second half of hf_gate_up: import)", "megatron_lite/checkpoint/hf.py",
             'torch.cat([t[m + f"gate_proj.{kind}"], t[m + f"up_proj.{kind}"]])',
             'torch.cat([t[m + f"up_proj.{kind}"], t[m + f"gate_proj.{kind}"]])', ()),
    Mutation("zb_h1_store", "ZB-H1: the weight-gradient store never installed (W work not deferred)",
             "megatron_lite/parallel/pipeline/schedules.py",
             "    with run.store.installed(model[0]):\n",
             "    with __import__('contextlib').nullcontext():\n",
             ("tests/distributed/test_zero_bubble.py",)),
    Mutation("zb_zero_w_flush", "ZB-H1 + ZeRO-2/3: a W pass does not reduce-scatter its gradients at its end",
             "megatron_lite/parallel/data_parallel.py",
             "            self._queue_flush()  # a backward that did not start at this chunk's output: a zero-bubble W pass\n",
             "            pass\n", ("tests/distributed/test_zero_bubble_sharded.py",)),
    Mutation("zb_zero3_unit_wait", "ZB-H1 + ZeRO-3: in B a deferred weight's bucket waits for W (units stay gathered)",
             "megatron_lite/parallel/data_parallel.py",
             "                if self.shard_grads and id(param) in self.deferred and id(param) not in self._bucket_of[id(param)].ready:\n",
             "                if False:\n", ("tests/distributed/test_zero_bubble_sharded.py",)),
    Mutation("zb_zero_mixed_buckets", "ZB-H1 + ZeRO-2/3: deferred weights share buckets with B's gradients (2x traffic)",
             "megatron_lite/parallel/fsdp.py",
             '        kwargs["deferred"] = deferred_params(module)', "        pass",
             ("tests/distributed/test_zero_bubble_sharded.py",)),
    Mutation("dist_expert_keys", "torch_dist: experts keyed by local instead of global number",
             "megatron_lite/checkpoint/dist.py",
             "        firsts = _first_experts(module)\n", "        firsts = {}\n",
             ("tests/e2e/test_torch_dist_moe.py::test_ep2_torch_dist_checkpoint_merges_into_the_one_process_model",)),
    # issue: test strength by mutation (parallel core, MoE, LR, resume, MLA/MTP, SFT). Missed at first,
    # each now caught by the test named for it:
    Mutation("distopt_found_inf", "distributed optimizer: the found-inf flag not MAX-reduced over DP",
             "megatron_lite/optim/distrib_optimizer.py",
             "groups = (self.state.dp_cp_group, self.state.mp_group, self.state.ep_group)",
             "groups = (self.state.mp_group, self.state.ep_group)",
             ("tests/distributed/test_distrib_optimizer.py::test_an_overflow_seen_by_one_data_parallel_rank_skips_the_step_on_all",)),
    Mutation("moe_capacity_ceil", "MoE: expert capacity rounded down instead of up",
             "megatron_lite/moe/routing.py", "math.ceil(num_tokens * topk / num_experts * capacity_factor)",
             "int(num_tokens * topk / num_experts * capacity_factor)",
             ("tests/unit/test_moe_router.py::test_capacity_dropping_by_probs_and_position",)),
    Mutation("lr_warmup_end", "LR: the last warmup step (n = W) taken by the decay phase",
             "megatron_lite/optim/lr_scheduler.py", "if self.warmup_steps > 0 and n <= self.warmup_steps:",
             "if self.warmup_steps > 0 and n < self.warmup_steps:", ("tests/unit/test_lr_scheduler.py",)),
    Mutation("mtp_loss_depth", "MTP: the depths' loss scaled by the factor but not divided by D",
             "pretrain_gpt.py", "mtp_loss_scaling_factor / depth * means[1:].sum()",
             "mtp_loss_scaling_factor * means[1:].sum()", ("tests/unit/test_pretrain_gpt_batch.py",)),
    Mutation("sft_packed_mask", "SFT packing: the label crossing into the next conversation is trained",
             "megatron_lite/data/sft_dataset.py", "loss_mask = trained[1:] & (document[1:] == document[:-1])",
             "loss_mask = trained[1:]", ("tests/unit/test_sft_data.py::test_padded_and_packed_sample_fields",)),
    Mutation("zero3_loaded_values", "ZeRO-3: values loaded into the gathered params dropped at re-sharding",
             "megatron_lite/parallel/fsdp.py", "if keep_values and min(e, end) > max(a, start):", "if False:",
             ("tests/distributed/test_fsdp.py::test_values_loaded_into_gathered_zero3_params_are_kept_in_the_shards",)),
    Mutation("lora_row_dropout_stream", "LoRA: a row adapter's dropout not drawn from the TP stream (one mask for all)",
             "megatron_lite/lora/adapters.py", 'if self.kind == "row" and comm.group_size(self.group) > 1:', "if False:",
             ("tests/distributed/test_lora_dropout.py",)),
    Mutation("cp_loss_factor", "GPT loss under CP: the backward loss not multiplied by cp",
             "pretrain_gpt.py", "means = sums * torch.distributed.get_world_size(cp_group) / total_counts",
             "means = sums / total_counts",
             ("tests/distributed/test_context_parallel.py::test_gpt_loss_under_cp_backpropagates_the_global_token_mean",)),
    Mutation("ddp_sp_grads", "DDP: sequence-parallel replicated gradients not summed over TP at finalize",
             "megatron_lite/parallel/data_parallel.py",
             "    all_reduce_sequence_parallel_grads(views, state.tp_group)\n", "    pass\n",
             ("tests/distributed/test_data_parallel.py::test_sequence_parallel_replicated_grads_are_summed_over_tp",)),
    Mutation("hsdp_replica_reduce", "HSDP (ZeRO-2/3 in instances): the gradient shard not all-reduced across instances",
             "megatron_lite/parallel/data_parallel.py",
             "            all_reduce_runs(self.grad_shards, self._replica_runs)  # hybrid sharding: once a step\n",
             "            pass\n", ("tests/distributed/test_zero_grads.py", "-k", "hybrid")),
    Mutation("mla_rope_key_grad", "MLA without SP: the shared rotary key's gradient not summed over TP",
             "megatron_lite/models/mla.py", "            k_rope = comm.copy_to_tp(k_rope, self.tp_group)\n",
             "            k_rope = k_rope\n", ("tests/distributed/test_mla_tp.py",
                                                 "tests/e2e/test_pretrain_deepseek.py::test_parallel_layout_reproduces_single_process")),
    Mutation("recompute_rng_restore", "activation recompute: the RNG states after backward not put back",
             "megatron_lite/parallel/random.py", "            _restore(now, ctx.tracker)\n", "            pass\n",
             ("tests/distributed/test_random.py::test_checkpoint_replays_dropout_and_restores_rng",)),
    # caught from the start; kept as guards of the parallel core's reductions:
    Mutation("xent_global_softmax", "vocab-parallel cross-entropy: backward uses the shard's own softmax",
             "megatron_lite/parallel/cross_entropy.py", "ratio = torch.exp(lse_local - lse) if size > 1 else None",
             "ratio = None", ("tests/distributed/test_cross_entropy.py",)),
    Mutation("norm_tp_duplicates", "grad norm: replicated parameters counted on every TP rank",
             "megatron_lite/optim/clip_grads.py", "    if is_tp_duplicate(param, state.tp_rank):\n", "    if False:\n",
             ("tests/distributed/test_optimizer.py",)),
    Mutation("distopt_chunk_end", "distributed optimizer: the last element of each owned chunk never stepped",
             "megatron_lite/optim/distrib_optimizer.py", "lo, hi = max(a, start), min(e, end)",
             "lo, hi = max(a, start), min(e, end - 1)", ("tests/distributed/test_distrib_optimizer.py",)),
    Mutation("pp_tied_embedding", "PP: the tied embedding's first/last-stage gradients not summed",
             "megatron_lite/parallel/data_parallel.py",
             "            dist.all_reduce(shared[0], group=state.embedding_group)\n", "            pass\n",
             ("tests/distributed/test_optimizer.py", "-k", "tied_embedding")),
    Mutation("resume_tracker_rng", "resume: the model-parallel RNG tracker's states not restored",
             "megatron_lite/checkpoint/rng.py", '    tracker.set_states(states["tracker"])\n', "    pass\n",
             ("tests/unit/test_checkpointing.py",)),
    Mutation("batch_row_positions", "continuous batching: per-row positions lost (each row's new tokens numbered from 0)",
             "megatron_lite/inference/paged_cache.py", "positions = starts[:, None] + torch.arange",
             "positions = 0 * starts[:, None] + torch.arange", ("tests/unit/test_continuous_batching.py",)),
    Mutation("paged_chunk_logprobs", "chunked prefill: a chunk that does not end the prefill keeps no log-probs",
             "megatron_lite/inference/batch_request.py", "            self.values[:, f:f + n] = _position_stats(",
             "            0 and _position_stats(", ("tests/unit/test_paged_batching.py",)),
    Mutation("paged_admit_without_blocks", "paged cache: a request admitted when rows are free but its blocks are not",
             "megatron_lite/inference/scheduler.py", "            if len(a.prompts) > rows or need > blocks:\n",
             "            if len(a.prompts) > rows:\n", ("tests/unit/test_paged_batching.py",)),
    Mutation("paged_stale_keys", "paged cache: keys a row does not own read from the pool instead of the zero block",
             "megatron_lite/inference/paged_cache.py", "torch.where(owned, slots, 0)", "slots",
             ("tests/unit/test_continuous_batching.py", "-k", "blocks")),
    Mutation("batch_tokens_broadcast", "continuous batching: the step's tokens not broadcast from the sampling rank",
             "megatron_lite/inference/stop_strings.py", "return engine._broadcast(new), ", "return new, ",
             ("tests/e2e/test_continuous_batching.py", "-k", "tp2")),
    Mutation("stream_partial_character", "OpenAI streaming: a window ending in part of a character sent as it is",
             "megatron_lite/inference/detokenize.py", " or whole != after or ", " or ",
             ("tests/unit/test_openai_stream.py", "-k", "split or incremental or character")),
    Mutation("openai_beam_order", "OpenAI beam search: each prompt's n worst hypotheses returned instead of its n best",
             "megatron_lite/inference/api_beam.py", "candidates[start:start + job.n]",
             "candidates[start + job.best_of - job.n:start + job.best_of]", ("tests/unit/test_openai_beam.py",)),
    # parallel folding (--expert-tensor-parallel-size independent of TP): each caught when written
    Mutation("folded_etp_group", "parallel folding: experts split over the TP group instead of the folded ETP group",
             "megatron_lite/moe/experts.py", "        return state.etp_group\n", "        return state.tp_group\n",
             ("tests/e2e/test_pretrain_moe.py", "-k", "folded_torch_checkpoint or etp2_ep2_dp4")),
    Mutation("folded_etp_bias_sum", "parallel folding: fc2's bias gradient not summed over the ETP group",
             "megatron_lite/parallel/data_parallel.py",
             '    all_reduce_sequence_parallel_grads(etp_views, getattr(state, "etp_group", None))\n', "    pass\n",
             ("tests/distributed/test_moe_grads.py", "-k", "expert_grads")),
    Mutation("folded_norm_count", "parallel folding: whole experts counted once per TP rank-0 instead of per shard",
             "megatron_lite/optim/clip_grads.py",
             '        return getattr(param, "tensor_model_parallel", False) or state.etp_rank == 0\n', "        pass\n",
             ("tests/distributed/test_moe_grads.py", "-k", "expert_grads")),
    Mutation("folded_dist_boxes", "parallel folding: torch_dist expert boxes placed by TP rank instead of ETP rank",
             "megatron_lite/checkpoint/dist.py", "if expert and state.folded else", "if False else",
             ("tests/e2e/test_pretrain_moe.py::test_folded_etp2_checkpoint_resumes_at_etp1",)),
    Mutation("folded_torch_writers", "parallel folding: torch-format files written by expert-DP rank 0 only",
             "megatron_lite/checkpoint/expert_files.py", "    mine = _shards(state.grid, state.rank)\n",
             "    return state.expert_dp_rank == 0\n", ("tests/unit/test_expert_grid.py",)),
    Mutation("folded_convert_optim", "converter: a folded target's expert moments cut over TP instead of ETP",
             "megatron_lite/checkpoint/reshard.py", "etp=None if x is None else (x, layout.etp_size)),", "etp=None),",
             ("tests/distributed/test_convert_moe.py", "-k", "folded")),
    Mutation("folded_convert_dense", "converter: a folded source's dense optimizer state from EP rank 0's files only",
             "megatron_lite/checkpoint/reshard_optim.py", "for k, o in stage if k[0] == t), None)",
             "for k, o in stage if k[0] == t and k[2] == e), None)", ("tests/distributed/test_convert_moe.py", "-k", "folded")),
    Mutation("sink_grad_sign", "attention sinks: the learnable sink's gradient with the wrong sign",
             "megatron_lite/parallel/attention_sink.py", "    return -(torch.exp(", "    return (torch.exp(",
             ("tests/unit/test_attention_sink.py",)),
    Mutation("prefix_evict_keeps_name", "prefix caching: a named block handed out again keeps its name (stale reuse)",
             "megatron_lite/inference/paged_cache.py", "        if b in self.names:\n            del self.cached",
             "        if False:\n            del self.cached", ("tests/unit/test_prefix_caching.py",)),
    Mutation("prefix_answer_unnamed", "prefix caching: the blocks a row's generated tokens fill are never named",
             "megatron_lite/inference/paged_cache.py", "self.written[r].extend(self._fed[i])", "pass",
             ("tests/unit/test_prefix_caching.py", "-k", "chat")),
    # the README/docs promise audit (feat/hunt-promises): each passed every test before its test was added
    Mutation("vocab_init_order", "TP init: a master weight drawn column-major (the real vocabulary rows then "
             "depend on the padded size, which grows with TP)", "megatron_lite/parallel/tensor.py",
             "    master = torch.empty(full_shape, dtype=torch.float32)\n    init_method(master)\n",
             "    master = torch.empty(tuple(reversed(full_shape)), dtype=torch.float32)\n    init_method(master)\n"
             "    master = master.t() if master.dim() == 2 else master\n",
             ("tests/unit/test_gpt_model.py", "-k", "padded_size")),
    Mutation("offload_host_unclipped", "optimizer CPU offload: the host half steps unclipped gradients",
             "megatron_lite/optim/distrib_optimizer.py", "        self._step_clipped(grad_norm, grads)\n",
             "        self._step_clipped(grad_norm, [g for p, g in zip(self.pieces, grads) if not p.offloaded])\n",
             ("tests/e2e/test_sharded_data_parallel.py", "-k", "offload_half_at_dp2")),
    Mutation("nonfinite_nan_only", "--check-for-nan-in-loss-and-grad: an infinite loss not caught as such",
             "megatron_lite/training/nonfinite.py", "if loss is not None and not math.isfinite(loss):",
             "if loss is not None and math.isnan(loss):", ("tests/e2e/test_user_errors.py", "-k", "nan_loss")),
    Mutation("recompute_uniform_ignores_n", "full uniform recomputation: groups of one layer whatever n",
             "megatron_lite/models/transformer.py",
             "range(0, n, self.recompute_num_layers):\n                end = min(start + self.recompute_num_layers, n)",
             "range(0, n, 1):\n                end = min(start + 1, n)",
             ("tests/unit/test_gpt_model_recompute.py", "-k", "method_names or recompute_equals")),
    Mutation("recompute_block_one_more", "full block recomputation: n + 1 layers checkpointed",
             "megatron_lite/models/transformer.py", "if full and i < self.recompute_num_layers:",
             "if full and i <= self.recompute_num_layers:",
             ("tests/unit/test_gpt_model_recompute.py", "-k", "method_names or recompute_equals")),
    Mutation("nccl_algo_any", "--deterministic-mode on CUDA: any NCCL_ALGO accepted, not only Megatron-LM's list",
             "megatron_lite/distributed_flags.py", "algo not in DETERMINISTIC_NCCL_ALGOS", "not algo",
             ("tests/unit/test_distributed_flags.py", "-k", "deterministic")),
    Mutation("tokens_per_s_not_per_device", "the log line's tokens per second per device: the whole run's",
             "megatron_lite/training/logging.py", "/ max(self._time, 1e-12) / self.world_size",
             "/ max(self._time, 1e-12)", ("tests/unit/test_logging.py",)),
    Mutation("tflops_not_per_gpu", "the log line's throughput per GPU: the whole run's",
             "megatron_lite/training/logging.py", "/ 1e12 / self.world_size", "/ 1e12", ("tests/unit/test_logging.py",)),
    Mutation("progress_job_not_per_gpu", "--log-progress: the job throughput is the whole run's, not per GPU",
             "megatron_lite/training/progress.py", "/ max(time.time() - self.start_time, 1e-9) / 1e12 / self.world_size",
             "/ max(time.time() - self.start_time, 1e-9) / 1e12", ("tests/unit/test_progress_log.py",)),
    Mutation("warmup_fraction_ignored", "--lr-warmup-fraction: no warmup (the fraction ignored in both modes)",
             "megatron_lite/optim/lr_scheduler.py",
             "self.warmup_steps = fraction * self.decay_steps if fraction is not None else int(warmup)",
             "self.warmup_steps = 0 if fraction is not None else int(warmup)",
             ("tests/unit/test_lr_scheduler.py", "tests/unit/test_train_samples.py")),
    Mutation("exit_not_agreed", "--exit-signal-handler: each rank exits on its own signal (no agreement; the "
             "others hang: run with MEGATRON_LITE_TEST_TIMEOUT=40)", "megatron_lite/training/loop.py",
             "    if not dist.is_initialized():\n        return list(flags)\n",
             "    if True:\n        return list(flags)\n", ("tests/e2e/test_exit_agreement.py",)),
    Mutation("sigterm_handler_kept", "pretrain(): its SIGTERM handler left installed after the run",
             "megatron_lite/training/loop.py", "    with contextlib.closing(exit_signal):",
             "    with contextlib.nullcontext():", ("tests/e2e/test_exit_agreement.py", "-k", "given_back")),
    # the promise audit of inference, fine-tuning, deepseek-v3, data, MoE and checkpoint docs (feat/promises2):
    # each passed every test before its test was added
    Mutation("generate_temperature0_samples", "tools/generate.py: --temperature 0 samples at temperature 1 (not greedy)",
             "tools/generate.py", "    greedy = args.greedy or args.temperature == 0\n", "    greedy = args.greedy\n",
             ("tests/unit/test_generate_cli.py",)),
    Mutation("generate_logprobs_generated_only", "tools/generate.py --log-probs: only the generated tokens printed",
             "tools/generate.py", "zip(result.tokens[1:], result.log_probs)",
             "zip(result.tokens[result.prompt_length:], result.log_probs[result.prompt_length - 1:])",
             ("tests/unit/test_generate_cli.py",)),
    Mutation("context_limit_seq_length", "learned positions: the context is --seq-length, not --max-position-embeddings",
             "megatron_lite/inference/loading.py", 'return int(saved.get("max_position_embeddings") or saved["seq_length"])',
             'return int(saved["seq_length"])', ("tests/unit/test_generate_cli.py",)),
    Mutation("lm_eval_auto_batch_8", "lm-eval backend: batch_size auto is 8, not 16",
             "megatron_lite/inference/lm_eval_backend.py", 'self.batch_size = _int("batch_size", batch_size, 16)',
             'self.batch_size = _int("batch_size", batch_size, 8)', ("tests/unit/test_lm_eval_backend.py", "-k", "wins_over")),
    Mutation("ppl_uncapped", "tools/evaluate.py: ppl = exp(avg loss) without Megatron's cap at exp(20)",
             "megatron_lite/inference/evaluation.py", "math.exp(min(20.0, loss)), len(tokens)", "math.exp(loss), len(tokens)",
             ("tests/unit/test_evaluate.py", "-k", "capped")),
    Mutation("adjusted_ppl_uncapped", "tools/evaluate.py: the adjusted ppl without the cap at exp(20)",
             "megatron_lite/inference/evaluation.py", "math.exp(min(20.0, self.loss * ratio))",
             "math.exp(self.loss * ratio)", ("tests/unit/test_evaluate.py", "-k", "capped")),
    Mutation("server_prefix_caching_off", "run_text_generation_server.py: prefix caching off by default",
             "tools/run_text_generation_server.py", '("--enable-prefix-caching", "enable_prefix_caching", True)',
             '("--enable-prefix-caching", "enable_prefix_caching", False)',
             ("tests/unit/test_paged_batching.py", "-k", "paged_cache_flags")),
    Mutation("openai_default_temperature", "OpenAI routes: a request without temperature samples at 0.7",
             "megatron_lite/inference/api_openai.py", 'get_number(body, "temperature", 1.0,',
             'get_number(body, "temperature", 0.7,', ("tests/unit/test_openai_fields.py",)),
    Mutation("api_default_tokens_16", "PUT /api: tokens_to_generate defaults to 16, not 64",
             "megatron_lite/inference/api_megatron.py", 'get_int(body, "tokens_to_generate", 64, low=0)',
             'get_int(body, "tokens_to_generate", 16, low=0)', ("tests/unit/test_api_megatron_fields.py",)),
    Mutation("tokenizer_path_relative", "checkpoints record the run's tokenizer paths as given (relative to its folder)",
             "megatron_lite/checkpoint/format.py", "            flat[key] = os.path.abspath(flat[key])\n",
             "            pass\n", ("tests/unit/test_checkpoint_tokenizer_paths.py",)),
    Mutation("sft_eod_mask_loss_taken", "--sft with --eod-mask-loss: taken (and ignored)",
             "megatron_lite/data/sft_dataset.py", '("--eod-mask-loss", d.eod_mask_loss), ', "",
             ("tests/e2e/test_sft.py", "-k", "sft_flag_errors")),
    Mutation("sft_second_eod", "SFT: an EOD appended after a chat template that already ends with one",
             "megatron_lite/data/chat_template.py",
             "if not add_generation_prompt and eod is not None and (not out.ids or out.ids[-1] != eod):",
             "if not add_generation_prompt and eod is not None:", ("tests/unit/test_sft_data.py", "-k", "eod_gets_no")),
    Mutation("sft_files_equal_weights", "SFT: several files without weights blended equally, not by conversations",
             "megatron_lite/data/sft_dataset.py", "normalize_weights([len(c) for c in sets])", "normalize_weights([1 for c in sets])",
             ("tests/unit/test_sft_data.py", "-k", "several_files")),
    Mutation("sft_pad_is_eod", "SFT: samples padded with the EOD although the tokenizer has a pad token",
             "megatron_lite/data/sft_dataset.py", "pad=int(eod if pad is None else pad)", "pad=int(eod)",
             ("tests/unit/test_sft_data.py", "-k", "padding_is")),
    Mutation("lora_init_std_half", "LoRA: A drawn with half Xavier-normal's variance",
             "megatron_lite/lora/adapters.py", "std = math.sqrt(2.0 / (rows + cols))", "std = math.sqrt(1.0 / (rows + cols))",
             ("tests/unit/test_lora.py", "-k", "xavier")),
    Mutation("rope_type_default_rope", "--rope-type defaults to rope with multi-latent attention too (not yarn)",
             "megatron_lite/models/mla_config.py",
             'config.rope_type = "yarn" if config.multi_latent_attention else "rope"', 'config.rope_type = "rope"',
             ("tests/unit/test_rope_type_default.py",)),
    Mutation("dsv3_export_biases", "deepseek_v3 export: a model with biases exported (the biases dropped)",
             "megatron_lite/checkpoint/hf_deepseek.py", '(cfg.get("disable_bias_linear"), "biases (no --disable-bias-linear)"',
             '(True, "biases (no --disable-bias-linear)"', ("tests/unit/test_hf_deepseek.py", "-k", "export_refuses")),
    Mutation("blend_prefixes_equal", "--data-path prefixes without weights blended equally, not by token counts",
             "megatron_lite/data/builder.py", "weights = [float(np.sum(d.sequence_lengths, dtype=np.int64)) for d in indexed]",
             "weights = [1.0 for d in indexed]", ("tests/unit/test_data_builder.py", "-k", "token_counts")),
    Mutation("moe_shared_overlap_ignored", "--moe-shared-expert-overlap taken and ignored",
             "megatron_lite/moe/config.py",
             '    "moe_shared_expert_overlap": "overlapping shared experts with the dispatcher is not implemented",\n', "",
             ("tests/unit/test_moe_config.py", "-k", "unbuilt")),
    Mutation("moe_fp16_folded_etp", "fp16 with a folded expert-tensor-parallel size: taken",
             "megatron_lite/moe/config.py", "    if fp16 and etp not in (None, 1, tp):", "    if False:",
             ("tests/unit/test_moe_config.py", "-k", "bad_combinations")),
    Mutation("mixtral_export_layernorm", "mixtral export: a LayerNorm model written (as RMSNorm)",
             "megatron_lite/checkpoint/hf_mixtral.py", '_require(cfg.get("normalization") == "RMSNorm", "--normalization LayerNorm',
             '_require(True, "--normalization LayerNorm', ("tests/distributed/test_convert_moe.py", "-k", "mixtral_refuses")),
    Mutation("bert_export_swiglu", "megatron-bert export: a SwiGLU BERT written (its gate dropped)",
             "megatron_lite/checkpoint/hf_bert.py", '(not cfg.get("swiglu"), "--swiglu"), ', "",
             ("tests/unit/test_hf_bert_export_checks.py",)),
    Mutation("gptoss_partial_rotary", "gpt_oss import: partial_rotary_factor refused for MLA's reason",
             "megatron_lite/checkpoint/hf_gptoss.py", '_require(rope.get("partial_rotary_factor", 1.0) == 1.0, "partial_rotary_factor cannot be expressed (gpt-oss "',
             '_require(True, "partial_rotary_factor cannot be expressed (gpt-oss "',
             ("tests/unit/test_hf_gptoss.py", "-k", "import_refuses")),
    Mutation("mla_head_dims_unused_taken", "--qk-head-dim / --qk-pos-emb-head-dim without MLA: taken and ignored",
             "megatron_lite/models/mla_config.py",
             'MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")',
             'MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "v_head_dim")', ("tests/unit/test_unused_model_flags.py",)),
    Mutation("generate_bf16_as_fp16", "the inference tools' --bf16 loads the model in float16",
             "megatron_lite/inference/cli.py", "return torch.bfloat16 if args.bf16 else", "return torch.float16 if args.bf16 else",
             ("tests/unit/test_generate_cli.py",)),
    Mutation("openai_five_stops", "OpenAI routes: five stop strings taken (OpenAI's limit is 4)",
             "megatron_lite/inference/api_openai.py", "or len(stops) > 4:", "or len(stops) > 5:",
             ("tests/unit/test_openai_fields.py", "-k", "documented_limits")),
    Mutation("openai_logprobs_21", "/v1/completions: logprobs 21 taken (OpenAI's limit is 20)",
             "megatron_lite/inference/api_openai.py", 'get_int(body, "logprobs", None, low=0, high=20)',
             'get_int(body, "logprobs", None, low=0, high=21)', ("tests/unit/test_openai_fields.py", "-k", "documented_limits")),
    Mutation("api_256_prompts", "PUT /api: up to 256 prompts taken (the documented limit is 128)",
             "megatron_lite/inference/api_megatron.py", "MAX_PROMPTS = 128", "MAX_PROMPTS = 256",
             ("tests/unit/test_api_megatron_fields.py", "-k", "documented_limits")),
    Mutation("api_256_beams", "PUT /api: beam widths up to 256 taken (the documented limit is 128)",
             "megatron_lite/inference/api_megatron.py", "MAX_BEAMS = 128", "MAX_BEAMS = 256",
             ("tests/unit/test_api_megatron_fields.py", "-k", "documented_limits")),
    Mutation("lm_eval_bfloat16_as_float16", "lm-eval backend: dtype=bfloat16 loads the model in float16",
             "megatron_lite/inference/lm_eval_backend.py", '"bfloat16": (True, False)', '"bfloat16": (False, True)',
             ("tests/unit/test_lm_eval_backend.py", "-k", "dtype_model_arg")),
    Mutation("lm_eval_context_cut_right", "lm-eval loglikelihood: a long context cut on the right (the continuation lost)",
             "megatron_lite/inference/lm_eval_backend.py", "[((ctx + cont)[-(self.max_length + 1):], len(cont))",
             "[((ctx + cont)[:self.max_length + 1], len(cont))", ("tests/unit/test_lm_eval_backend.py", "-k", "cut_on_the_left")),
    Mutation("lm_eval_generation_context_uncut", "lm-eval generate_until: the context kept to max_length, not max_length - max_gen_toks",
             "megatron_lite/inference/lm_eval_backend.py", "keep = max(1, self.max_length - params.tokens_to_generate)",
             "keep = max(1, self.max_length)", ("tests/unit/test_lm_eval_backend.py", "-k", "cut_on_the_left")),
    Mutation("lambada_strict_last_token_only", "--strict-lambada: an example counts when the last token alone is right",
             "megatron_lite/inference/evaluation.py", "            correct += all(result.greedy[-n:])",
             "            correct += result.greedy[-1]", ("tests/unit/test_evaluate.py", "-k", "lambada")),
    Mutation("lambada_long_text_cut_right", "LAMBADA: a text longer than the window loses its end (the target)",
             "megatron_lite/inference/evaluation.py", "examples.append((tokens[-(seq_length + 1):], n))",
             "examples.append((tokens[:seq_length + 1], n))", ("tests/unit/test_evaluate.py", "-k", "lambada")),
    Mutation("dsv3_declared_mtp_missing", "deepseek_v3 import: a config counting MTP layers the weights lack is not "
             "imported without MTP", "megatron_lite/checkpoint/hf_deepseek.py", "    if declared and not any(present):",
             "    if False:", ("tests/unit/test_hf_deepseek.py", "-k", "does_not_hold")),
    Mutation("hf_auto_qwen2_with_biases", "--hf-style auto: qwen2 for a rope model with biases everywhere (llama holds them)",
             "megatron_lite/checkpoint/hf.py", 'if cfg.get("add_qkv_bias") and cfg.get("disable_bias_linear"):',
             'if cfg.get("add_qkv_bias"):', ("tests/unit/test_hf_style_auto.py",)),
]
# mutations applied together with the one before them (one bug spread over two places)
COMBINED = {"hf_gate_up": ["hf_gate_up_import"]}


def _scratch() -> str:
    folder = tempfile.mkdtemp(prefix="mutation-")
    for name in COPY:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(folder, name), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, folder)
    return folder


def _apply(folder: str, m: Mutation) -> None:
    path = os.path.join(folder, m.path)
    with open(path) as f:
        text = f.read()
    found = text.count(m.old)
    if found != m.count:
        raise ValueError(f"{m.name}: {m.path} holds the text to replace {found} times, expected {m.count}")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def _run_tests(folder: str, tests: tuple[str, ...]) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=folder, OMP_NUM_THREADS="1", COLUMNS="1000")  # untruncated summaries
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *tests]
    out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def _failures(log: str) -> list[str]:
    """``test id: first assertion line`` of each failed test in a pytest log."""
    lines = []
    for line in log.splitlines():
        if line.startswith("FAILED "):
            lines.append(re.sub(r"\s+", " ", line[len("FAILED "):])[:300])
    return lines


def probe(m: Mutation, control: bool) -> str:
    folder = _scratch()
    try:
        if control:
            rc, log = _run_tests(folder, m.tests)
            if rc != 0:
                return f"error: the tests fail unmutated (rc {rc})\n{log[-3000:]}"
        for part in [m] + [x for x in MUTATIONS if x.name in COMBINED.get(m.name, [])]:
            _apply(folder, part)
        start = time.time()
        rc, log = _run_tests(folder, m.tests)
        took = f"{time.time() - start:.0f} s"
        if rc == 0:
            return f"MISSED ({took}): every test passed"
        if rc != 1:
            return f"error (rc {rc}, {took}): the tests did not run\n{log[-3000:]}"
        return f"caught ({took}) by:\n" + "\n".join(f"    {line}" for line in _failures(log))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutations to probe (default: all)")
    ap.add_argument("--control", action="store_true", help="first run each mutation's tests unmutated")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if m.tests and (not args.names or m.name in args.names)]
    missed = 0
    for m in chosen:
        print(f"[{m.name}] {m.what}\n  tests: {' '.join(m.tests)}", flush=True)
        verdict = probe(m, args.control)
        missed += not verdict.startswith("caught")
        print(f"  {verdict}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
