"""vLLM's prompt parts of a reply: a text completion's echoed prompt, and ``prompt_logprobs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.text.token_text import TokenText


def prompt_logprobs(entries: list[Any], text_of: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's form: per prompt position (the first ``None``), the prompt's token and the top ones, each
    by id with its logprob, rank and text."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        at = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": text_of(e.token_id)}}
        for rank, (t, lp) in enumerate(e.top.items(), 1):
            at.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": text_of(t)})
        out.append(at)
    return out


@dataclass(frozen=True, slots=True)
class Echo:
    """A choice's prompt, written before its text: the text, its tokens' logprobs (``text_logprobs``'
    form, or ``None`` when none were asked) and where the choice's first token's text starts."""

    text: str
    logprobs: dict[str, list[Any]] | None
    num_chars: int


def echo(prompt_ids: list[int], given: str | None, entries: list[Any] | None, text_of: TokenText) -> Echo:
    """The echo of a prompt of ``prompt_ids``: ``given`` (a string prompt as sent) or the ids decoded;
    with ``entries`` (its prompt logprobs) the tokens' logprobs, offsets counted as the text's are."""
    text = given if given is not None else text_of.tokenizer.decode(prompt_ids)
    offsets, offset = [], 0
    for t in prompt_ids:
        offsets.append(offset)
        offset += len(text_of.text(t))
    if entries is None:
        return Echo(text, None, offset)
    logprobs = {"tokens": [text_of(t) for t in prompt_ids],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {text_of(t): lp for t, lp in e.top.items()}
                                 for e in entries],
                "text_offset": offsets}
    return Echo(text, logprobs, offset)


def prepend(choice: dict[str, Any], echoed: Echo, *, is_shifted: bool) -> None:
    """Write ``echoed`` before a text choice's text and logprobs; ``is_shifted``: the choice's offsets
    already count from its first token (a stream's), else from 0."""
    choice["text"] = echoed.text + choice["text"]
    lp = choice["logprobs"]
    if echoed.logprobs is None or lp is None:
        return
    if not is_shifted:
        lp["text_offset"] = [echoed.num_chars + x for x in lp["text_offset"]]
    choice["logprobs"] = {k: echoed.logprobs[k] + lp[k] for k in lp}


@dataclass(frozen=True, slots=True)
class Prompts:
    """What a reply's prompt parts are made from: each prompt's ids, ``n`` choices per prompt, the
    string prompts to echo as sent (``None`` where the ids are decoded; no tuple: no echo), whether the
    text's logprobs were asked (an echo writes the prompt's too) and whether ``prompt_logprobs`` was."""

    ids: list[list[int]]
    n: int
    echo_texts: tuple[str | None, ...] | None
    has_logprobs: bool
    has_prompt_logprobs: bool

    def echo_of(self, out: Any, index: int, text_of: TokenText) -> Echo:
        p = index // self.n
        entries = (out.prompt_logprobs or {}).get(p) if self.has_logprobs else None
        return echo(self.ids[p], self.echo_texts[p], entries, text_of)  # type: ignore[index]

    def add_to(self, body: dict[str, Any], kind: str, out: Any, text_of: TokenText) -> None:
        """A whole reply's: each text choice's echo; the prompt logprobs, a text choice's own prompt's
        beside it, a chat's beside its choices."""
        if self.echo_texts is not None:
            for c in body["choices"]:
                prepend(c, self.echo_of(out, c["index"], text_of), is_shifted=False)
        if not self.has_prompt_logprobs or not out.prompt_logprobs:
            return
        lists = {p: prompt_logprobs(entries, text_of) for p, entries in out.prompt_logprobs.items()}
        if kind == "chat":
            body["prompt_logprobs"] = lists.get(0)
            return
        for c in body["choices"]:
            c["prompt_logprobs"] = lists.get(c["index"] // self.n)
