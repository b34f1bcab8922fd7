"""Sampling parameters and per-sequence state (what a request asks for and where it stands); the
outputs handed back to callers are in ``engine.outputs``."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.determinism import MODES as _MODES
from engine.errors import InvalidSamplingParamsError
from engine.outputs import TokenLogprobs
from engine.structured import StructuredOutput

MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_ALLOWED_TOKEN_IDS = 4096  # each step scatters them into the request's row
MAX_BAD_WORDS = 256  # token sequences; each step looks up the row's last tokens once per sequence length
MAX_BAD_WORD_TOKENS = 32


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidSamplingParamsError(msg)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        n: Independent completions per prompt (they share the prompt's KV blocks).
        max_tokens: Most tokens to generate (capped by the context left).
        temperature: 0 means greedy.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Keep the k most likely tokens; 0 or -1 disables.
        min_p: In [0, 1]: keep only the tokens at least this fraction as likely as the most likely one (after
            the temperature, before top-k and top-p); 0 disables.
        seed: Makes sampling reproducible; draws depend only on (seed, sample index, position).
        stop: Strings that end generation; the stop string is not returned.
        stop_token_ids: Token ids that end generation (returned in ``token_ids``).
        ignore_eos: Keep generating past the end-of-sequence token.
        min_tokens: Generate at least this many tokens (at most ``max_tokens``): until then the
            end-of-sequence token, ``stop_token_ids`` and ``stop`` strings do not end the sequence (a
            token that would have is kept in ``token_ids``, as with ``ignore_eos``).
        logprobs: Return the top-N log-probabilities per generated token (0 = only the chosen one).
        prompt_logprobs: Return the top-N log-probabilities of each prompt token after the first (0 = only
            the prompt's own), 0 to 20: every prompt position then runs through the LM head, and the
            prompt never comes from the prefix cache, whose positions would have none.
        skip_special_tokens: Leave special tokens out of ``text``.
        spaces_between_special_tokens: ``True``: a space between each added (special) token and the text
            beside it in ``text``, as vLLM and Hugging Face write them with a Python tokenizer; ``False``
            or ``None`` (as the tokenizer decodes, vLLM's with a fast tokenizer): none.
        include_stop_str_in_output: A ``stop`` string that ends the text stays in it (at its end).
        bad_words_token_ids: Token sequences the output must not hold (vLLM's ``bad_words``, tokenized): a
            sequence's last token is masked out wherever the generated tokens end with its others (at
            most ``MAX_BAD_WORDS`` sequences of 1 to ``MAX_BAD_WORD_TOKENS`` ids).
        truncate_prompt_tokens: Run only the prompt's last k tokens (each prompt's); -1 keeps the last
            ``max_model_len``; more than the context holds is refused when the request is added.
        allowed_token_ids: Sample only among these token ids (1 to ``MAX_ALLOWED_TOKEN_IDS``; ids past
            the model's vocabulary are refused when the request is added).
        determinism: ``fast``, ``fixed`` or ``batch_invariant``; ``None`` takes the engine's default.
        presence_penalty: In [-2, 2]: subtracted from the logit of every token already generated.
        frequency_penalty: In [-2, 2]: times its count, subtracted from the logit of each generated token.
        repetition_penalty: In (0, 2]: the logit of every token of the prompt or the output is divided by it
            where positive and multiplied where negative (1 disables).
        logit_bias: Token id -> bias in [-100, 100] added to its logit (at most 300 entries; ids past the
            model's vocabulary are refused when the request is added).
        structured: What the generated text must match (``engine.structured.StructuredOutput``).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words_token_ids: list[list[int]] | None = None
    determinism: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= 128, f"n must be an integer in [1, 128], got {self.n!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be a finite number in [0, 100], got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= -1, got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20),
                   f"{name} must be an integer in [0, 20], got {value!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a non-empty string or a list of non-empty strings")
        self.stop = list(self.stop)
        self._check_token_fields()
        _check(self.determinism is None or self.determinism in _MODES,
               f"determinism must be one of {_MODES}, got {self.determinism!r}")
        self._check_penalties()
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               "structured must be a StructuredOutput")

    def _check_token_fields(self) -> None:
        """The fields that name token ids or say how the prompt and text are made of tokens."""
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0
                                                                       for t in self.stop_token_ids),
               "stop_token_ids must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS
                   and all(_is_int(t) and t >= 0 for t in ids),
                   f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} non-negative integers")
            self.allowed_token_ids = list(ids)
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            _check(isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS and all(
                isinstance(w, (list, tuple)) and 0 < len(w) <= MAX_BAD_WORD_TOKENS
                and all(_is_int(t) and t >= 0 for t in w) for w in words),
                f"bad_words_token_ids must be at most {MAX_BAD_WORDS} lists of 1 to {MAX_BAD_WORD_TOKENS} "
                "non-negative integers")
            self.bad_words_token_ids = [list(w) for w in words]
        keep = self.truncate_prompt_tokens
        _check(keep is None or (_is_int(keep) and (keep == -1 or keep >= 1)),
               f"truncate_prompt_tokens must be -1 or a positive integer, got {keep!r}")
        _check(self.spaces_between_special_tokens in (None, True, False),
               "spaces_between_special_tokens must be a boolean or None")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0,
                   f"{name} must be a number in [-2, 2], got {value!r}")
        _check(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
               f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}")
        if self.logit_bias is None:
            return
        _check(isinstance(self.logit_bias, dict), "logit_bias must map token ids to numbers")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
               f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are accepted")
        for token, bias in self.logit_bias.items():
            _check(_is_int(token) and token >= 0, f"logit_bias keys must be token ids >= 0, got {token!r}")
            _check(_is_num(bias) and -100.0 <= bias <= 100.0,
                   f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    @property
    def has_penalties(self) -> bool:
        """Any of the presence, frequency or repetition penalties, or a logit bias, is set."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Sequence:
    """Hot, mutable per-token state of one sequence (one of a request's ``n`` samples).

    ``all_token_ids`` is prompt followed by output. ``num_computed_tokens`` counts tokens whose K/V are
    in the cache; after a preemption it drops to 0 and the whole thing is recomputed.
    """

    __slots__ = ("seq_id", "request_id", "sample_index", "params", "prompt_len", "all_token_ids",
                 "status", "num_computed_tokens", "num_cached_tokens", "block_ids", "priority",
                 "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time",
                 "finish_time", "logprobs", "cache_namespace", "sample_seed", "max_len",
                 "num_preemptions", "stop_reason", "token_times", "num_prefill_computed", "mode",
                 "tenant", "matcher", "mask", "penalty", "bad_words", "prompt_logprobs")

    def __init__(self, seq_id: int, request_id: str, sample_index: int, prompt_token_ids: list[int],
                 params: SamplingParams, *, arrival_time: float, priority: int = 0,
                 cache_namespace: bytes = b"", sample_seed: int = 0, max_len: int,
                 mode: str = "fast") -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served from the prefix cache
        self.num_prefill_computed = 0       # prompt tokens actually run through the model
        self.block_ids: list[int] = []
        self.priority = priority
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []
        self.logprobs: list[TokenLogprobs] = []
        self.cache_namespace = cache_namespace
        self.sample_seed = sample_seed
        self.max_len = max_len              # prompt + generated never exceeds this
        self.num_preemptions = 0
        self.stop_reason: str | int | None = None
        self.mode = mode                    # determinism mode, resolved against the engine default
        self.tenant = None                  # the scheduler's fair-share account (engine.sched.fair.Tenant)
        # structured outputs: the grammar's matcher, advanced by each appended token (engine.grammar.compiler)
        self.matcher = None
        self.mask = None                    # its next token's mask, computed ahead (engine.grammar.masks)
        self.penalty = None                 # token counts for the penalties (runner.logits.PenaltyState)
        self.bad_words = None               # its bad words as prefix lookups (runner.logits.BadWords)
        # prompt_logprobs, on a prompt's first sample only: by position (the first has none), filled as
        # its prefill runs; a preempted prefill fills the same places again
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.prompt_len:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs asked and the prompt not all computed: no prefix-cache hit may skip a position."""
        return self.prompt_logprobs is not None and self.num_computed_tokens < self.prompt_len

    @property
    def is_mask_pending(self) -> bool:
        """A grammar row whose next token's mask is still computing: it cannot sample yet."""
        return self.mask is not None and not self.mask.done()

    def __repr__(self) -> str:  # never the prompt itself: lengths only
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, prompt_len={self.prompt_len}, "
                f"out_len={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")
