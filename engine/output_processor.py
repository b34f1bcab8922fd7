"""Per-request output state: stop conditions, incremental text, and each step's RequestDelta."""

from __future__ import annotations

from engine.determinism import FAST, token_hash_chain
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import StructuredOutputError
from engine.outputs import RequestDelta, RequestMetrics, SampleDelta, TokenLogprobs
from engine.request import RequestStatus, SamplingParams, Sequence

_NO_TOKEN = "NoExtensionBias"  # llguidance's stop reason when a mask allows no token


class _SampleText:
    """Text state of one sample: incremental decoder plus what was last handed out."""

    __slots__ = ("detok", "text", "sent_tokens", "sent_text", "token_hash", "stop_floor")

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.text = ""
        self.stop_floor = 0  # a stop string must end past this much text (what came before min_tokens)
        self.sent_tokens = 0
        self.sent_text = 0
        self.token_hash: str | None = None  # the finished sample's receipt, hashed once


class RequestState:
    """A request's samples: ``params.n`` per prompt, each sample's text decoded after its own prompt."""

    def __init__(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 seqs: list[Sequence], tokenizer, eos_token_ids: tuple[int, ...], fingerprint: str = "",
                 arrival_step: int = 0) -> None:
        self.request_id = request_id
        self.arrival_step = arrival_step
        self.fingerprint = fingerprint
        # what the first delta reports: the prompts' ids one after the other (their length is the usage)
        self.prompt_ids = [t for ids in prompts for t in ids]
        self.params = params
        self.seqs = seqs
        self.eos = () if params.ignore_eos else eos_token_ids
        self.samples = [_SampleText(IncrementalDetokenizer(
            tokenizer, prompts[s.sample_index // params.n], params.skip_special_tokens,
            params.spaces_between_special_tokens)) for s in seqs]
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self._is_first = True  # the first delta carries the prompt's ids
        self._prompt_logprobs_sent: set[int] = set()  # prompts whose logprobs a delta carried

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                     now: float) -> RequestStatus | None:
        """Record a sampled token; return the finishing status if the sequence is done."""
        seq.all_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        seq.token_times.append(now)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        sample = self.samples[seq.sample_index]
        # Before min_tokens nothing but the length ends a sequence (vLLM's rule: the min_tokens-th can).
        is_min_met = seq.num_output_tokens >= self.params.min_tokens
        stop_token = is_min_met and (token in self.params.stop_token_ids or token in self.eos)
        if seq.matcher is not None and self._advance_grammar(seq, token):
            stop_token = True  # the grammar is complete: nothing may follow, whatever min_tokens says
        sample.text += sample.detok.add(token, final=stop_token or seq.num_tokens >= seq.max_len)
        if not is_min_met:
            sample.stop_floor = len(sample.text)
        if stop_token:
            seq.stop_reason = token if token in self.params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if self._max_stop and is_min_met and self._check_stop_strings(seq, sample):
            return RequestStatus.FINISHED_STOPPED
        if seq.num_tokens >= seq.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> bool:
        """Feed the grammar its sampled token; whether the grammar has ended (it allows nothing more).

        The mask allowed only tokens the matcher accepts, so a refusal is a broken invariant. A matcher
        that stopped while computing that mask (no token of the vocabulary can go on: the grammar needs a
        byte that no token holds) let only the end of text through, which would end the text unmatched:
        the request fails, its own spec's fault.

        Raises:
            StructuredOutputError: The grammar can go no further with this model's vocabulary.
        """
        if seq.matcher.is_error():
            error = seq.matcher.get_error().partition("\n")[0]
            why = "no token of this model's vocabulary can continue it" if error == _NO_TOKEN else error
            raise StructuredOutputError(f"the structured output stopped after {seq.num_output_tokens - 1} "
                                        f"token(s): {why}")
        if not seq.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused its own sampled token {token}: "
                               f"{seq.matcher.get_error()}")
        return seq.matcher.is_stopped()

    def _check_stop_strings(self, seq: Sequence, sample: _SampleText) -> bool:
        # Only the tail can hold a new match: the last delta plus len(stop) - 1 characters before it.
        window_start = max(0, sample.sent_text - self._max_stop)
        best = -1
        for stop in self.params.stop:
            idx = sample.text.find(stop, max(window_start, sample.stop_floor - len(stop) + 1))
            if idx != -1 and (best == -1 or idx < best):
                best, seq.stop_reason = idx, stop
        if best == -1:
            return False
        kept = len(seq.stop_reason) if self.params.include_stop_str_in_output else 0
        sample.text = sample.text[:best + kept]
        return True

    def make_delta(self) -> RequestDelta:
        """What each sample produced since the previous delta. Unfinished text is held back by the longest
        stop string less one character, so a stop string found later is never partly handed out."""
        samples = []
        for seq, sample in zip(self.seqs, self.samples, strict=True):
            if seq.status is RequestStatus.FINISHED_ABORTED or (seq.is_finished and seq.status is not
                                                                RequestStatus.FINISHED_STOPPED):
                sample.text += sample.detok.flush(final=True)
            num_out = seq.num_output_tokens
            new_ids = seq.all_token_ids[seq.prompt_len + sample.sent_tokens:]
            new_lps = seq.logprobs[sample.sent_tokens:] if self.params.logprobs is not None else None
            end = len(sample.text) if seq.is_finished else len(sample.text) - max(self._max_stop - 1, 0)
            new_text = sample.text[sample.sent_text:end] if end > sample.sent_text else ""
            samples.append(SampleDelta(
                seq.sample_index, new_ids, new_text, new_lps,
                finish_reason=seq.status.value if seq.is_finished else None,
                stop_reason=seq.stop_reason, token_hash=self._token_hash(seq, sample)))
            sample.sent_tokens, sample.sent_text = num_out, max(sample.sent_text, end)
        prompt_ids, self._is_first = (self.prompt_ids if self._is_first else None), False
        # each prompt's cached tokens once, as its first sample found them (the others share its blocks)
        num_cached = sum(s.num_cached_tokens for s in self.seqs[::self.params.n])
        return RequestDelta(self.request_id, samples, self.finished, num_cached,
                            self._metrics(), self.seqs[0].mode, self.fingerprint, prompt_ids,
                            self._new_prompt_logprobs())

    def _new_prompt_logprobs(self) -> dict[int, list[TokenLogprobs | None]] | None:
        """The prompt logprobs of each prompt whose prefill is done since the last delta (once each)."""
        if self.params.prompt_logprobs is None:
            return None
        done = {}
        for p, seq in enumerate(self.seqs[::self.params.n]):
            if p not in self._prompt_logprobs_sent and seq.prompt_logprobs is not None and (
                    seq.num_computed_tokens >= seq.prompt_len):
                done[p] = seq.prompt_logprobs
                self._prompt_logprobs_sent.add(p)
        return done or None

    def _token_hash(self, seq: Sequence, sample: _SampleText) -> str | None:
        """The receipt of a finished fixed/batch_invariant sample (its siblings may run on for steps)."""
        if sample.token_hash is None and seq.is_finished and seq.mode != FAST:
            sample.token_hash = token_hash_chain(self.fingerprint, seq.output_token_ids)
        return sample.token_hash

    def _metrics(self) -> RequestMetrics:
        seq = self.seqs[0]
        m = RequestMetrics(arrival_time=seq.arrival_time,
                           num_preemptions=sum(s.num_preemptions for s in self.seqs),
                           arrival_step=self.arrival_step)
        if seq.first_scheduled_time is not None:
            m.queue_time = seq.first_scheduled_time - seq.arrival_time
        if seq.first_token_time is not None:
            m.time_to_first_token = seq.first_token_time - seq.arrival_time
        if len(seq.token_times) > 1:
            m.mean_time_per_output_token = ((seq.token_times[-1] - seq.token_times[0])
                                            / (len(seq.token_times) - 1))
        m.finish_time = seq.finish_time
        return m
