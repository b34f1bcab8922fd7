"""LLMEngine: the synchronous step loop over scheduler, model runner and output processing."""

from __future__ import annotations

import itertools
import logging
import random
import time
import uuid
from collections.abc import Sequence as Seq

from engine.config import EngineConfig
from engine.determinism import BATCH_INVARIANT
from engine.errors import InvalidRequestError, RequestFailedError, StepError
from engine.front.stream_output import OutputAccumulator
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.masks import GrammarMasks
from engine.grammar.waiting import GrammarQueue
from engine.output_processor import RequestState
from engine.outputs import RequestDelta, RequestOutput
from engine.protocol import ENGINE_REQUEST_VERSION, EngineRequest
from engine.request import RequestStatus, SamplingParams, Sequence
from engine.request_checks import RESERVED_NS, check_add_args, fitted_length, tokenize_prompts, truncated
from engine.runner.model_runner import ModelRunner
from engine.runner.overlap import SampledStep, StepOverlap
from engine.runner.setup import LoadedModel, load_model, setup_determinism
from engine.sched.fair import TenantShare
from engine.sched.hashing import BlockHasher
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler
from engine.stats import EngineStats, StatsTracker

logger = logging.getLogger("kvgate.engine")
_GRAMMAR_WAIT_S = 0.02  # with nothing to run, how long a step waits for a grammar to compile


class LLMEngine:
    """Paged-KV inference engine: continuous batching, chunked prefill, preemption, prefix cache.

    Example:
        >>> engine = LLMEngine(EngineConfig())
        >>> [out] = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
        >>> out.text, out.finish_reason
    """

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None,
                 hasher: BlockHasher | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded or load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_model_len = self.loaded.max_model_len
        self.block_size = config.block_size
        self.kv = KVCacheManager(self.loaded.num_blocks, config.block_size,
                                 enable_prefix_caching=config.enable_prefix_caching, hasher=hasher,
                                 max_cached_per_namespace=config.max_cached_blocks_per_namespace,
                                 guaranteed_per_namespace=config.guaranteed_blocks(self.loaded.num_blocks))
        self.kv.pool.zero_on_free = config.zero_freed_blocks
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.loaded.model, self.loaded.kv_caches, config.block_size,
                                  self.loaded.device)
        self.runner.enable_cuda_decode(config.max_num_seqs, config.cuda_graphs)
        self.requests: dict[str, RequestState] = {}
        self._accumulators: dict[str, OutputAccumulator] = {}  # ``step``'s whole outputs, per request
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.stats_tracker = StatsTracker()
        self.determinism = setup_determinism(config, self.loaded)
        self.runner.tile_plan = self.determinism.tile_plan
        mc = self.loaded.model_config
        self.overlap = StepOverlap(self.runner, self.scheduler, config.overlap_steps)
        self._held: SampledStep | None = None  # a decode step drawn ahead, recorded by the next call
        self.masks = GrammarMasks(deadline_s=config.grammar_mask_deadline_s)
        self.grammars = GrammarQueue(GrammarCompiler(self.tokenizer, vocab_size=mc.vocab_size,
                                                     eos_token_ids=self.loaded.eos_token_ids), self.masks)

    # ---- requests -------------------------------------------------------------------------------
    def add(self, request: EngineRequest) -> str:
        """Queue ``request`` (``add_request`` of its fields).

        Raises:
            InvalidRequestError: ``add_request``'s, and a request of another ``EngineRequest`` version.
            PromptTooLongError: ``add_request``'s.
        """
        if request.version != ENGINE_REQUEST_VERSION:
            raise InvalidRequestError(f"engine request version {request.version}; this engine reads "
                                      f"version {ENGINE_REQUEST_VERSION}")
        return self.add_request(request.prompt, request.params, request.request_id,
                                cache_namespace=request.cache_namespace, priority=request.priority,
                                share=request.share)

    def add_request(self, prompt: str | Seq[int] | Seq[Seq[int]], params: SamplingParams | None = None,
                    request_id: str | None = None, *, cache_namespace: bytes = b"", priority: int = 0,
                    arrival_time: float | None = None, share: TenantShare | None = None) -> str:
        """Queue a request.

        Args:
            prompt: Text (tokenized without special tokens) or token ids; or a list of token-id prompts,
                each run ``params.n`` times (output ``index`` is ``prompt_index * n + i``, vLLM's).
            params: Sampling parameters; defaults to ``SamplingParams()``.
            request_id: Unique id; generated when omitted.
            cache_namespace: Opaque prefix-cache scope; blocks are never shared across namespaces.
            priority: Lower runs first under the ``priority`` and ``fair`` scheduling policies (within
                a tenant under ``fair``).
            share: The request's tenant, weight and KV block cap under the ``fair`` policy; requests
                without one share one default account.

        Returns:
            The request id.

        Raises:
            InvalidRequestError: Empty or out-of-vocabulary prompt, duplicate id, bad parameters, more
                than ``MAX_SEQS_PER_REQUEST`` sequences.
            PromptTooLongError: A prompt exceeds the context, or prompt + max_tokens the whole KV pool.
        """
        params = params or SamplingParams()
        vocab = self.loaded.model_config.vocab_size
        check_add_args(params, share, cache_namespace, vocab)
        try:
            mode = self.determinism.resolve(params.determinism, self.config.determinism)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if mode == BATCH_INVARIANT:  # its K/V come from another kernel: never share blocks with other modes
            cache_namespace = RESERVED_NS + b"bi:" + cache_namespace
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompts = truncated(tokenize_prompts(self.tokenizer, prompt, params.n, vocab),
                            params.truncate_prompt_tokens, self.max_model_len)
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = self._make_seqs(request_id, prompts, params, now, priority=priority,
                               cache_namespace=cache_namespace, mode=mode)
        fingerprint = self.determinism.fingerprints[mode]
        # a request whose grammar is not compiled yet waits outside the scheduler (``_admit_compiled``)
        is_ready = params.structured is None or self.grammars.add(request_id, seqs, params.structured, share)
        self.requests[request_id] = RequestState(request_id, prompts, params, seqs, self.tokenizer,
                                                 self.loaded.eos_token_ids, fingerprint, self.num_steps)
        if is_ready:
            self._schedule(seqs, share)
        return request_id

    def _make_seqs(self, request_id: str, prompts: list[list[int]], params: SamplingParams, now: float, *,
                   priority: int, cache_namespace: bytes, mode: str) -> list[Sequence]:
        """``params.n`` sequences per prompt, sample ``p * n + i`` the ``i``-th of prompt ``p``; every
        prompt checked against the context before any is made."""
        max_lens = [fitted_length(ids, params.max_tokens, self.max_model_len, self.kv) for ids in prompts]
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        n = params.n
        seqs = [Sequence(next(self._seq_ids), request_id, p * n + i, ids, params, arrival_time=now,
                         priority=priority, cache_namespace=cache_namespace, sample_seed=base_seed,
                         max_len=max_len, mode=mode)
                for p, (ids, max_len) in enumerate(zip(prompts, max_lens, strict=True)) for i in range(n)]
        if params.prompt_logprobs is not None:  # a prompt's first sample computes them for all n
            for seq in seqs[::n]:
                seq.prompt_logprobs = [None] * seq.prompt_len
        return seqs

    def _schedule(self, seqs: list[Sequence], share: TenantShare | None) -> None:
        n = seqs[0].params.n
        for seq in seqs:  # a prompt's first sample leads: the others wait to share its cached prompt blocks
            leader = seqs[seq.sample_index - seq.sample_index % n]
            self.scheduler.add(seq, leader=leader if leader is not seq else None, share=share)

    def _admit_compiled(self, failed: dict[str, BaseException]) -> None:
        """Schedule requests whose grammar is ready (arriving now, for a replay); failures into ``failed``."""
        ready, errors = self.grammars.poll()
        for seqs, share in ready:
            self.requests[seqs[0].request_id].arrival_step = self.num_steps
            self._schedule(seqs, share)
        failed.update(errors)

    def _settle_masks(self, failed: dict[str, BaseException]) -> None:
        """Wait briefly for grammar rows' next masks; end the rows whose mask failed or is overdue (their
        errors into ``failed``) before the step is scheduled, so that only rows with a mask are drawn."""
        errors = self.masks.settle([s for s in self.scheduler.running if s.matcher is not None])
        for request_id in errors:
            self._drop(request_id)
        failed.update(errors)

    def _wait_for_grammars(self) -> None:
        """Nothing could run: wait a little for a grammar to compile or a held row's mask to be done."""
        self.grammars.wait(_GRAMMAR_WAIT_S)
        self.masks.wait_any([s for s in self.scheduler.running if s.matcher is not None], _GRAMMAR_WAIT_S)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request, freeing its blocks at once. Unknown or finished ids are ignored."""
        delta = self.abort_delta(request_id)
        return None if delta is None else self._assemble(delta)

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        """``abort``, answering with the request's last delta instead of its whole output."""
        state = self._drop(request_id)
        if state is None:
            return None
        self._zero_freed_blocks()
        return state.make_delta()

    def _drop(self, request_id: str) -> RequestState | None:
        """Forget a request, ending its unfinished sequences (their blocks are freed at once)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.grammars.drop(request_id)
            for seq in state.seqs:
                if seq.tenant is None:  # never scheduled: it was waiting for its grammar
                    seq.status = RequestStatus.FINISHED_ABORTED
                elif not seq.is_finished:
                    self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        return state

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_steps(self) -> int:
        """Forward passes run so far (a request's ``arrival_step`` counts them)."""
        return self.stats_tracker.num_steps

    # ---- stepping -------------------------------------------------------------------------------
    def _zero_freed_blocks(self) -> None:
        """With ``zero_freed_blocks``, wipe the K/V of blocks freed without a hash (or evicted) since the
        last call. Runs only between forward passes, so a block is wiped before a new owner writes it."""
        if self.kv.pool.blocks_to_zero:
            self.runner.zero_blocks(self.kv.pool.blocks_to_zero)
            self.kv.pool.blocks_to_zero.clear()

    def step_deltas(self) -> list[RequestDelta]:
        """``step``, returning what each progressed request produced in this step only (what the engine
        process sends: its size does not grow with the requests' lengths).

        On CUDA, with ``overlap_steps``, a decode step's sampled tokens may be recorded one call later,
        while the device runs the next decode step (``engine.runner.overlap``): the deltas a call returns are
        then the previous forward pass's, and every call still returns one pass's worth.

        Raises:
            StepError: The step raised for some requests and ended those only (a forward pass that raises
                runs again one request at a time); the others' deltas ride on the error.
        """
        sampled, self._held = self._held, None
        if sampled is None:
            failed: dict[str, BaseException] = {}
            self._admit_compiled(failed)
            self._settle_masks(failed)
            sched = self.scheduler.schedule()
            if sched.is_empty:
                if failed:
                    raise StepError([], self._fail(failed), is_total=False)
                self._wait_for_grammars()
                return []
            self._zero_freed_blocks()  # freed while scheduling (preemption, eviction): before anyone writes
            t0 = time.perf_counter()
            is_decode = self.runner.is_decoder_step(sched.scheduled)
            seqs, tokens, logprobs = self.runner.execute_isolating(sched.scheduled, failed)
            sampled = SampledStep(sched.scheduled, seqs, tokens, logprobs, failed,
                                  time.perf_counter() - t0, is_decode)
            if not failed:  # a step that failed rows ran them again one at a time: not its cost
                self.scheduler.observe_step(sampled.seconds)
        # runs while this one is recorded; never with grammar rows (their next masks follow the recording)
        ahead = self.overlap.launch(sampled, len(self.grammars) > 0
                                    or any(s.matcher is not None for s in sampled.seqs))
        deltas, errors = self._record(sampled)
        if ahead is not None:
            self._held = self.overlap.draw(ahead)
        if errors:  # total: every request the step ran failed (a grammar's compile error is no fault of it)
            ran = {seq.request_id for seq, _ in sampled.scheduled}
            raise StepError(deltas, errors, is_total=ran <= errors.keys())
        return deltas

    def _record(self, sampled: SampledStep) -> tuple[list[RequestDelta], dict[str, BaseException]]:
        """Append a forward pass's sampled tokens (ending sequences that stop), count the step; the
        deltas of the requests it advanced and the errors of those it failed."""
        failed = sampled.failed
        now = time.monotonic()
        # a held step's sequence may have been aborted since it was drawn (its id may even be reused)
        self._advance([(s, n) for s, n in sampled.scheduled if not s.is_finished], failed)
        touched: dict[str, RequestState] = {}
        grammar_rows: list[list[Sequence]] = []
        for seq, token, lp in zip(sampled.seqs, sampled.tokens, sampled.logprobs, strict=True):
            if seq.request_id in failed or seq.is_finished:
                continue
            state = touched[seq.request_id] = self.requests[seq.request_id]
            try:
                status = state.append_token(seq, token, lp, now)
                if status is not None:
                    self.scheduler.finish(seq, status)
                elif seq.matcher is not None:
                    grammar_rows.append([seq])
            except Exception as e:  # noqa: BLE001
                failed.setdefault(seq.request_id, e)
        self.masks.start(grammar_rows)  # their next masks compute while this step ends and the next begins
        deltas = self._make_deltas(touched, failed)
        errors = self._fail(failed)
        self._zero_freed_blocks()  # freed by finished requests: now, not when the next request comes
        self.stats_tracker.record_step(sum(n for _, n in sampled.scheduled), len(sampled.tokens),
                                       sampled.seconds)
        return deltas, errors

    def _advance(self, scheduled: list[tuple[Sequence, int]], failed: dict[str, BaseException]) -> None:
        """Count each sequence's newly computed tokens, and cache the blocks they filled."""
        for seq, n in scheduled:
            if seq.request_id in failed:
                continue
            try:
                if seq.num_computed_tokens < seq.prompt_len:
                    k = min(n, seq.prompt_len - seq.num_computed_tokens)
                    seq.num_prefill_computed += k
                    self.kv.pool.record_computed(seq.cache_namespace, k)
                seq.num_computed_tokens += n
                self.kv.cache_full_blocks(seq)
            except Exception as e:  # noqa: BLE001
                failed[seq.request_id] = e

    def _make_deltas(self, touched: dict[str, RequestState], failed: dict[str, BaseException]
                     ) -> list[RequestDelta]:
        deltas = []
        for request_id, state in touched.items():
            if request_id in failed:
                continue
            try:
                deltas.append(state.make_delta())
            except Exception as e:  # noqa: BLE001
                failed[request_id] = e
                continue
            if state.finished:
                del self.requests[request_id]
        return deltas

    def _fail(self, failed: dict[str, BaseException]) -> dict[str, BaseException]:
        """End the requests a step failed, freeing their blocks; the error each one's caller gets."""
        for request_id, e in failed.items():
            is_own = isinstance(e, InvalidRequestError)  # the request's fault: a grammar that cannot compile
            logger.log(logging.INFO if is_own else logging.ERROR, "an engine step failed request %s: %s",
                       request_id, e, exc_info=None if is_own else e)
            self._drop(request_id)
            self._accumulators.pop(request_id, None)
        return {rid: e if isinstance(e, InvalidRequestError) else RequestFailedError(
            f"request {rid} failed in an engine step ({type(e).__name__}: {e})") for rid, e in failed.items()}

    # ---- whole outputs: the offline API, assembled from each step's deltas -------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and return outputs of requests that progressed (raises
        as ``step_deltas`` does, with the other requests' outputs as the ``StepError``'s ``deltas``)."""
        try:
            deltas = self.step_deltas()
        except StepError as e:
            e.deltas = [self._assemble(delta) for delta in e.deltas]
            raise
        return [self._assemble(delta) for delta in deltas]

    def _assemble(self, delta: RequestDelta) -> RequestOutput:
        acc = self._accumulators.get(delta.request_id)
        if acc is None:
            acc = self._accumulators[delta.request_id] = OutputAccumulator(delta.request_id)
        acc.add(delta)
        if delta.finished:
            del self._accumulators[delta.request_id]
        return acc.snapshot()

    def generate(self, prompts: str | Seq[int] | list,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; one result per prompt, in order.

        Args:
            prompts: One prompt or a list of prompts.
            params: One ``SamplingParams`` for all prompts, or a list with one per prompt.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("params must be one SamplingParams or a list with one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stats(self, *, namespaces: bool = True) -> EngineStats:
        """A snapshot of queue, KV and throughput figures; ``namespaces``: with the per-namespace
        breakdown (namespaces that hold or cache KV blocks now)."""
        return self.stats_tracker.snapshot(self.scheduler, self.kv, namespaces=namespaces)
