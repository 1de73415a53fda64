"""Continuous batching: requests join and leave one decode batch between steps.

:class:`Scheduler` decodes every admitted request together. Each :meth:`~Scheduler.step` first
admits requests (each takes one row of the :class:`~.paged_cache.PagedCache` per prompt, and is
promised the cache blocks its rows can hold at once - all they can grow to, or with every layer
windowed those of the prefill or the window: a request whose rows or blocks are not free waits,
in arrival order), then runs one step of every request: a request just admitted runs its prefill
(its prompts up to the shortest one's length), the others feed one token each, in one forward pass
per number of new tokens over their rows (each row at its own length and positions). With
``max_batched_tokens`` (``--max-num-batched-tokens``) a step feeds at most that many tokens: the
decoding sequences one each, and the prefills, in admission order, a chunk each of what is left
(chunked prefill: a long prompt takes several steps, and the other requests decode meanwhile; a
chunk that does not end its prefill samples nothing and makes no event). A request whose every
sequence has ended leaves at once and frees its rows and blocks for the next one, so a short
request sent after a long one ends first.

Per request, a step is exactly one step of :meth:`InferenceEngine.stream
<megatron_lite.inference.engine.InferenceEngine.stream>` over its prompts alone: the same
teacher forcing of the longer prompts, the same sampling parameters (temperature, top-k / top-p
and its decay, penalties over the request's own generated tokens, ``logit_bias``, banned tokens,
stop tokens, ``tokens_to_generate``), the same log-probs, and its own sampling generator (seeded
with ``random_seed``; without one, the engine's shared generator). So a request's tokens do not
depend on what else is in the batch: greedy and seeded samples give the tokens the request gets
alone, and its log-probs differ only by the order of the sums inside attention (fp32: ~1e-6). A
seeded request that ends leaves the shared generator where its own ended, as the one-at-a-time
engine, which reseeds the shared one (Megatron's ``random_seed``): an unseeded request sent after
it (nothing else in flight) draws the tokens it draws there.

Parallel layouts: every rank calls :meth:`step` with the same admissions (the server's rank 0
decides them with :meth:`admissions` and broadcasts them), so every rank runs the same forward
passes; the sampling rank broadcasts the step's tokens of every row at once, and every rank then
decides alike which sequences and requests ended. A request whose logits hold NaN or inf fails
alone (:class:`~.sampling.NonFiniteLogitsError` in its :class:`Event`), and so does one whose own
state, sampling or bookkeeping raises (that error in its event, on every rank: the sampling rank
marks its rows, then sends the message); the others go on with the tokens they get alone. Only a
failure of a shared forward pass fails every request in the step.

Not covered (the caller runs them one at a time with the engine, as before): beam search,
``tokens_to_generate`` 0 (scoring), and a request of more sequences than the cache has rows. A
request needing more blocks than the whole cache holds is refused (ValueError: HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.window_config import cache_reach
from .batch_request import Admission, BatchRequest, every_sequence
from .engine import Generation, InferenceEngine, Step, _check_prompts, _step_log_probs, check_vocabulary
from .paged_cache import PagedCache
from .sampling import NonFiniteLogitsError, SamplingParams
from .stop_strings import broadcast_tokens


@dataclass
class Event:
    """What one step did for request ``rid``: its :class:`~.engine.Step`, and when it ended its
    results (or the error that ended it)."""

    rid: int
    step: Step | None = None
    results: list[Generation] | None = None
    error: Exception | None = None


class Scheduler:
    """Continuous batching over ``engine`` (see the module docstring) with at most ``max_rows``
    sequences decoding together (``--inference-max-requests``), their tokens in a
    :class:`~.paged_cache.PagedCache` of ``num_blocks`` blocks of ``block_size`` tokens (default: as
    many as ``max_rows`` full contexts), at most ``max_batched_tokens`` tokens per step (prefills
    chunked to fit; None: every prefill whole)."""

    def __init__(self, engine: InferenceEngine, max_rows: int, *, block_size: int = 16, num_blocks: int | None = None,
                 max_batched_tokens: int | None = None, prefix_caching: bool = False):
        if max_batched_tokens is not None and max_batched_tokens < max_rows:
            raise ValueError(f"--max-num-batched-tokens {max_batched_tokens} must be at least --inference-max-requests "
                             f"{max_rows} (every decoding sequence feeds one token per step)")
        self.engine, self.max_batched_tokens = engine, max_batched_tokens
        self.cache = PagedCache(max_rows, engine.max_sequence_length, block_size, num_blocks, prefix_caching,
                                reach=cache_reach(engine.model.config))
        self.active: list[BatchRequest] = []
        self.pending: list[Admission] = []  # the deciding rank's queue
        self.next_rid = 0
        self.steps = 0  # forward steps run so far (the tests count decode steps with it)

    def covers(self, prompts: list[list[int]], params: SamplingParams) -> bool:
        """Whether the batch can run this request (else run it alone with the engine)."""
        return (params.tokens_to_generate > 0 and not params.beam_width and self.engine.use_cache
                and len(prompts) <= self.cache.max_rows)

    def add(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Queue a request (checked now: ValueError with one line); return its id."""
        params.check()
        _check_prompts(prompts, self.engine.max_sequence_length, params.tokens_to_generate, self.engine.vocab_size)
        check_vocabulary(params, self.engine.vocab_size, self.engine.printable_size)
        if not self.covers(prompts, params):
            raise ValueError("this request needs the one-at-a-time engine (beam search, scoring, or more "
                             f"sequences than --inference-max-requests {self.cache.max_rows})")
        rows, tokens, cache = len(prompts), _row_tokens(prompts, params), self.cache
        need = cache.cost(rows, tokens, prompts)  # with nothing cached (its choices may share their prompt)
        if need > cache.num_blocks:
            raise ValueError(f"this request needs {need} key/value-cache blocks of {cache.block_size} tokens ({rows} "
                             f"sequence(s) of up to {tokens} tokens), more than the {cache.num_blocks} of "
                             "--inference-kv-cache-blocks; raise it (or ask for fewer max_tokens)")
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.pending.append(Admission(rid, [list(p) for p in prompts], params))
        return rid

    @property
    def busy(self) -> bool:
        return bool(self.active or self.pending)

    def fail_all(self) -> list[int]:
        """End every admitted request (a step failed for the whole batch): free their rows, return their ids."""
        rids = [r.rid for r in self.active]
        for r in self.active:
            self._free(r)
        self.active = []
        return rids

    def admissions(self) -> list[Admission]:
        """The queued requests that join at the next step: in arrival order, while their sequences
        fit in the free rows and their blocks in the free blocks (a request that does not fit waits,
        and so do those after it)."""
        rows, blocks, out = len(self.cache.free), self.cache.available, []
        while self.pending:  # the need of each is counted as if it joined alone (never less than together)
            a = self.pending[0]
            need = self.cache.cost(len(a.prompts), _row_tokens(a.prompts, a.params), *_reuse(a))
            if len(a.prompts) > rows or need > blocks:
                break
            rows, blocks = rows - len(a.prompts), blocks - need
            out.append(self.pending.pop(0))
        return out

    def run_step(self) -> list[Event]:
        """:meth:`step` with :meth:`admissions` (one process, or the deciding rank's own call)."""
        return self.step(self.admissions())

    def step(self, admitted: list[Admission], leaving: tuple[int, ...] | list[int] = ()) -> list[Event]:
        """Drop the requests ``leaving`` (ids: their clients left), admit ``admitted`` and run one step
        of every request (every rank, the same arguments)."""
        for r in [r for r in self.active if r.rid in leaving]:
            self._free(r)
            self.active.remove(r)
        failed = self._admit(admitted)
        if not self.active:
            return failed
        self.steps += 1
        plan = self._plan()
        logits = self._forward(plan)
        whole = [r for r in self.active if plan[r.rid] == r.cur - r.filled]  # their step's tokens are all fed
        for r in self.active:
            if 0 < plan[r.rid] < r.cur - r.filled:
                r.prefilled(logits[r.rid], plan[r.rid])
        return failed + self._finish_step(logits, whole)

    def _admit(self, admitted: list[Admission]) -> list[Event]:
        """Give each admission its rows and state; one that fails (e.g. out of memory for its buffers,
        on any rank: the ranks agree) gets its error event and frees its rows, and the rest go on."""
        errors, joined = {}, []
        for a in admitted:
            rows = self.cache.allocate(len(a.prompts), _row_tokens(a.prompts, a.params), *_reuse(a))
            try:
                joined.append(BatchRequest(self.engine, a, rows, self.cache.lengths[rows[0]]))
            except Exception as err:  # noqa: BLE001 - this request's error alone
                errors[a.rid] = err
                self.cache.release(rows)
        if admitted and self.engine.state.world_size > 1:  # a request that failed on one rank fails on all
            flags = torch.tensor([a.rid in errors for a in admitted], dtype=torch.long, device=self.engine.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            for a, bad in zip(admitted, flags.tolist()):
                if bad and a.rid not in errors:
                    errors[a.rid] = RuntimeError(f"request {a.rid} failed to join the batch on another rank "
                                                 "(see that rank's log)")
        for r in [r for r in joined if r.rid in errors]:
            self._free(r)
        self.active += [r for r in joined if r.rid not in errors]
        return [Event(rid, error=err) for rid, err in errors.items()]

    def _plan(self) -> dict[int, int]:
        """The number of tokens each request feeds this step (0: it waits): every decoding request
        one per sequence, then the prefills in admission order, each in the largest chunk that the
        rest of ``max_batched_tokens`` holds (chunked prefill)."""
        if self.max_batched_tokens is None:
            return {r.rid: r.cur - r.filled for r in self.active}
        budget = self.max_batched_tokens - sum(len(r.held()) for r in self.active if r.cur - r.filled == 1)
        plan = {}
        for r in self.active:
            left, width = r.cur - r.filled, len(r.held())
            plan[r.rid] = 1 if left == 1 else min(left, budget // width)
            if left > 1:
                budget -= plan[r.rid] * width
        return plan

    def _forward(self, plan: dict[int, int]) -> dict[int, torch.Tensor | None]:
        """Logits ``[rows, s_new, V]`` of each request (None off the last stage): one forward pass
        per number of new tokens (decode steps and prefill chunks of equal length together)."""
        groups: dict[int, list[BatchRequest]] = {}
        for r in self.active:
            if plan[r.rid]:
                groups.setdefault(plan[r.rid], []).append(r)
        out = {}
        for s_new, group in groups.items():
            held = [r.held() for r in group]  # a request's ended sequences gave their rows back
            tokens = torch.cat([r.tokens[seqs, r.filled:r.filled + s_new] for r, seqs in zip(group, held)])
            rows = [r.rows[i] for r, seqs in zip(group, held) for i in seqs]
            fed = tokens.tolist() if self.cache.prefix_caching else None  # every rank's: names the blocks they fill
            positions, mask = self.cache.begin(rows, s_new, self.engine.device, fed)
            logits = self.engine.forward(tokens, self.cache, position_ids=positions, attention_mask=mask)
            self.cache.advance()
            start = 0
            for r, seqs in zip(group, held):
                out[r.rid] = None if logits is None else every_sequence(logits[start:start + len(seqs)], seqs, r)
                start += len(seqs)
        return out

    def _finish_step(self, logits: dict[int, torch.Tensor | None], stepped: list[BatchRequest]) -> list[Event]:
        """Sample, broadcast and record the tokens of the requests ``stepped`` (those whose step ran
        whole: not in the middle of a chunked prefill); the requests that ended leave. A request
        whose sampling or bookkeeping raises fails alone (its error event); the others go on."""
        if not stepped:
            return []
        engine, device = self.engine, self.engine.device
        sizes, errors = [len(r.rows) for r in stepped], {}
        new = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        if engine.is_src:
            new = torch.cat([self._sample(r, logits[r.rid], errors) for r in stepped])
        checks = [(None if r.rid in errors else r.checker, r.live()) for r in stepped] if engine.is_src else []
        new, hits = broadcast_tokens(engine, new, any(r.params.stop_strings for r in stepped), checks)
        flags, emitted = [], []
        for r, rows, hit in zip(stepped, new.split(sizes), hits.split(sizes)):
            e, over = (torch.full((len(r.rows),), flag, dtype=torch.bool, device=device) for flag in (False, True))
            if r.rid not in errors:
                try:
                    e, over = r.take(rows, logits[r.rid], hit)
                except Exception as err:  # noqa: BLE001 - this request's error alone (every rank raises it)
                    errors[r.rid] = err
            code = torch.tensor(2 if r.rid in errors else 0, device=device)
            flags += [torch.maximum(code, -rows.min().clamp(max=0)), over.all()]  # 1: NaN / inf, 2: failed
            emitted.append(torch.stack([e, over]))
        synced = torch.cat([torch.stack(flags).long(), torch.cat(emitted, 1).long().reshape(-1),
                            new.clamp(min=0)]).tolist()
        n_req, total = len(stepped), sum(sizes)
        em, ended_rows = synced[2 * n_req:2 * n_req + total], synced[2 * n_req + total:2 * n_req + 2 * total]
        toks = synced[2 * n_req + 2 * total:]
        self._share_errors(stepped, synced[0:2 * n_req:2], errors)
        events, ended, start = [], set(), 0
        for k, r in enumerate(stepped):
            code, done = synced[2 * k:2 * k + 2]
            rows = range(start, start + len(r.rows))
            start += len(r.rows)
            if code:
                events.append(Event(r.rid, error=errors[r.rid] if code == 2 else NonFiniteLogitsError()))
                self._free(r)
                ended.add(r.rid)
                continue
            step = Step(toks[i] if em[i] else None for i in rows)
            if r.params.step_log_probs:
                values = engine._broadcast(r.values[:, r.prev:r.cur].contiguous()).cpu()
                _step_log_probs(step, values, r.prev, r.params.top_n_logprobs)
            event = Event(r.rid, step=step)
            if done:
                event.results = r.results(engine._broadcast(r.values.contiguous()).cpu())
                if r.params.random_seed is not None:  # as the one-at-a-time engine's reseeded generator
                    engine.generator.set_state(r.generator.get_state())
                self._free(r)
                ended.add(r.rid)
            else:
                r.prev = r.filled = r.cur
                r.cur += 1
                self._free(r, [i for i, row in zip(range(len(r.rows)), rows) if ended_rows[row]])
            events.append(event)
        self.active = [r for r in self.active if r.rid not in ended]
        return events

    def _free(self, r: BatchRequest, sequences: list[int] | None = None) -> None:
        """Give back the cache rows of ``r``'s ``sequences`` (None: all) that still hold one."""
        sequences = range(len(r.rows)) if sequences is None else sequences
        self.cache.release([r.rows[i] for i in sequences if r.rows[i] is not None])
        for i in sequences:
            r.rows[i] = None

    @staticmethod
    def _sample(r: BatchRequest, logits: torch.Tensor, errors: dict) -> torch.Tensor:
        """``r``'s tokens of this step (the sampling rank); -2 in every row when sampling raised
        (its error kept in ``errors``)."""
        try:
            return r.sample(logits)
        except Exception as err:  # noqa: BLE001 - this request's error alone
            errors[r.rid] = err
            return torch.full((len(r.rows),), -2, dtype=torch.long, device=logits.device)

    def _share_errors(self, stepped: list[BatchRequest], codes: list[int], errors: dict) -> None:
        """Every rank gets the error of each request that failed (code 2): the sampling rank's
        message where it raised there."""
        missing = [r.rid for r, code in zip(stepped, codes) if code == 2 and r.rid not in errors]
        if self.engine.state.world_size > 1 and any(code == 2 for code in codes):
            box = [{rid: f"{type(err).__name__}: {err}" for rid, err in errors.items()}]
            dist.broadcast_object_list(box, src=self.engine.src)
            for rid in missing:
                errors[rid] = RuntimeError(box[0].get(rid, f"request {rid} failed (see the sampling rank's log)"))


def _reuse(a: Admission) -> tuple[list[list[int]] | None, int]:
    """:meth:`PagedCache.allocate <.paged_cache.PagedCache.allocate>`'s ``prompts`` and
    ``reuse_limit`` for ``a``: the cached prefix may cover all but the shortest prompt's last token
    (the first step must compute the logits it samples from), and none of it when the answer holds
    the prompt's log-probs (its rows still share their equal prompt blocks)."""
    return a.prompts, 0 if a.params.prompt_log_probs else min(len(p) for p in a.prompts) - 1


def _row_tokens(prompts: list[list[int]], params: SamplingParams) -> int:
    """The most tokens a sequence of this request holds in the cache: every sequence steps until the
    longest prompt plus ``tokens_to_generate`` (the last token is sampled, never fed)."""
    return max(len(p) for p in prompts) + params.tokens_to_generate - 1

