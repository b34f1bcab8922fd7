"""``kvgate replay``: re-run a recorded request from its audit receipt and check that it reproduces."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gateway.cli.app import app
from gateway.cli.common import DataDirOpt, DbUrlOpt, build_settings, run

if TYPE_CHECKING:
    from gateway.inference.receipts import Receipt

EXIT_MATCH, EXIT_OUTPUT_DIFFERS, EXIT_CANNOT_REPLAY, EXIT_PROMPT_DIFFERS, EXIT_OTHER_SYSTEM = 0, 1, 2, 3, 4
_REPLAY_KV_BYTES = 256 << 20  # one request needs little KV; the server's pool size never changes the bits
_FIXED_LIMIT = (
    "a fixed-mode request reproduces on its own only if it ran alone on the server (nothing else in "
    "flight, cold prefix cache); otherwise replay the whole recorded stream (engine.replay.run_stream)."
)

# One line per paragraph: the help renderer keeps hard line breaks.
_HELP = "\n\n".join(
    [
        "Re-run a recorded request and check that it reproduces.",
        "RECORD is the request id, or the audit event id of its request.admitted or request.finished "
        "event, read from the audit trail in --db-url / --data-dir (the data dir also holds the key of the "
        "keyed prompt hash).",
        "Give the prompt exactly as sent: --prompt-file for /v1/completions (the file's bytes as UTF-8, "
        "a trailing newline included; with --token-ids JSON: an array of token ids, or of several "
        "prompts), --messages-file for /v1/chat/completions (a JSON list of messages, or a request body "
        'with "messages") and for /v1/responses (its request body; one that continued a stored response '
        "takes that conversation as chat messages, and its body with --request-file); the chat "
        "template is applied exactly as the gateway does. A request with a structured output "
        "(response_format, guided_*), tools or chat template fields (add_generation_prompt, ...) needs "
        "its request body as sent, with --request-file (a chat's "
        "--messages-file may be that body): its tools reach the template and its constraint is checked "
        "against the recorded keyed hash. The request runs alone in a local engine built "
        "from the same settings as `kvgate serve` (--model, --dtype, --device, KVGATE_* variables) with the "
        "recorded parameters, seed and mode.",
        "Only fixed and batch_invariant requests carry token hashes to check. batch_invariant reproduces "
        f"whatever else ran beside it; {_FIXED_LIMIT}",
        f"Exit codes: {EXIT_MATCH} reproduced (prompt, system fingerprint and every choice's token hash "
        f"match); {EXIT_OUTPUT_DIFFERS} the output differs; {EXIT_CANNOT_REPLAY} cannot replay (unknown "
        f"record, fast mode, aborted request, bad input); {EXIT_PROMPT_DIFFERS} the prompt or the "
        "structured output does not match the recorded hash (nothing is run); "
        f"{EXIT_OTHER_SYSTEM} the output matches but the system fingerprint differs (other weights, "
        "tokenizer, engine version, dtype or kernel settings).",
    ]
)


class ReplayError(Exception):
    """The request cannot be replayed; the message says why."""


# request.admitted's feature names whose parameters receipts before version 2 did not record.
_UNRECORDED_BEFORE_V2 = frozenset({"json_schema", "json_object", "regex", "choice", "grammar", "tools",
                                   "logit_bias", "penalties"})


@dataclass(frozen=True, slots=True)
class _Record:
    event_id: str
    request_id: str
    data: dict[str, Any]
    features: tuple[str, ...] = ()  # request.admitted's


async def _find_record(db_url: str, ref: str) -> _Record:
    """The ``request.finished`` event of the request ``ref`` names (a request id or any event id of it)."""
    import orjson
    from sqlalchemy import bindparam, exc, or_, select

    from audit.events import REQUEST_ADMITTED, REQUEST_FINISHED
    from audit.store import make_audit_engine
    from audit.tables import audit_events as ev

    by_event = select(ev.c.request_id).where(ev.c.event_id == ref).scalar_subquery()
    query = (
        select(ev.c.event_id, ev.c.request_id, ev.c.data)
        .where(ev.c.name == REQUEST_FINISHED, or_(ev.c.request_id == ref, ev.c.request_id == by_event))
        .order_by(ev.c.seq.desc())
        .limit(1)
    )
    admitted_data = None
    admitted = select(ev.c.data).where(ev.c.name == REQUEST_ADMITTED, ev.c.request_id == bindparam("rid"))
    engine = make_audit_engine(db_url)
    try:
        async with engine.connect() as conn:
            row = (await conn.execute(query)).first()
            if row is not None:
                admitted_data = (await conn.execute(admitted, {"rid": row.request_id})).scalar()
    except exc.SQLAlchemyError as e:
        raise ReplayError(f"cannot read the audit trail: {type(e).__name__}") from None
    finally:
        await engine.dispose()
    if row is None:
        raise ReplayError(f"no finished request {ref!r} in the audit trail (request id or event id)")
    features = () if admitted_data is None else tuple(orjson.loads(admitted_data).get("features") or ())
    return _Record(row.event_id, row.request_id, orjson.loads(row.data), features)


def _receipt(record: _Record) -> Receipt:
    from gateway.inference.receipts import Receipt

    data = record.data
    # Checked on the record as stored: a prompt that is a mode's name is scrubbed from the record's words.
    if data.get("kind") is not None and (data.get("determinism") == "fast" or not data.get("token_hashes")):
        raise ReplayError(
            "fast mode records no token hash, so there is nothing to check (fast promises "
            "only seeded sampling); ask for fixed or batch_invariant to get a receipt"
        )
    try:
        receipt = Receipt.from_fields(data)
    except (ValueError, TypeError) as e:
        raise ReplayError(f"request {record.request_id} cannot be replayed: {e}") from None
    if data.get("is_aborted"):
        raise ReplayError("the request was aborted before it finished; its partial output cannot be replayed")
    if receipt.prompt_hash is None:
        raise ReplayError(
            "the record has no keyed prompt hash (the audit store was off), so the prompt cannot be checked"
        )
    unrecorded = sorted(_UNRECORDED_BEFORE_V2.intersection(record.features))
    if receipt.version < 2 and unrecorded:
        raise ReplayError(
            f"the request used {', '.join(unrecorded)}, whose parameters its receipt does not hold (recorded "
            "before receipts held penalties, logit_bias, min_tokens, ignore_eos and structured outputs)"
        )
    if receipt.params.temperature > 0 and receipt.params.seed is None:
        raise ReplayError(
            "the request sampled without a recorded seed; only greedy or seeded requests replay"
        )
    return receipt


def _read(path: Path, as_json: bool) -> Any:
    """A file's text (its bytes as UTF-8: text mode would rewrite \r\n), or the JSON it holds."""
    try:
        raw = path.read_bytes().decode("utf-8")
        return json.loads(raw) if as_json else raw
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReplayError(f"cannot read {path}: {detail}") from None


def _read_request(
    receipt: Receipt, prompt_file: Path | None, messages_file: Path | None, request_file: Path | None,
    token_ids: bool,
) -> Any:
    """The request the caller sent, rebuilt from the files through the API's own schemas: the prompt
    from its file, the rest (structured output, tools) from the request body, if one is given."""
    from pydantic import ValidationError

    from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest

    want, given = (
        ("--messages-file", messages_file) if receipt.kind == "chat" else ("--prompt-file", prompt_file)
    )
    if given is None or (prompt_file is not None and messages_file is not None):
        endpoint = "a chat completion" if receipt.kind == "chat" else "a text completion"
        raise ReplayError(f"the recorded request was {endpoint}: give its prompt with {want} (only)")
    body = {} if request_file is None else _read(request_file, as_json=True)
    try:
        if receipt.kind == "chat":
            data = _read(given, as_json=True)
            sent = data if isinstance(data, dict) and "input" in data else body
            if isinstance(sent, dict) and "input" in sent:  # a Responses API request, as sent
                earlier = data if isinstance(data, list) else []
                return _responses_chat(sent | {"model": receipt.model}, earlier)
            messages = data.get("messages") if isinstance(data, dict) else data
            if isinstance(data, dict) and request_file is None:
                body = data
            body = body | {"messages": messages}
            return ChatCompletionRequest.model_validate(body | {"model": receipt.model})
        prompt = _read(given, as_json=token_ids)
        return CompletionRequest.model_validate(body | {"model": receipt.model, "prompt": prompt})
    except (ValidationError, TypeError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReplayError(f"cannot read the request from {request_file or given}: {detail}") from None


def _responses_chat(body: dict[str, Any], earlier: list[Any]) -> Any:
    """The chat completion a Responses API request ran as (``gateway.inference.responses.to_chat``),
    after the ``earlier`` conversation it continued, if any.

    Raises:
        ReplayError: It continued a stored response (``previous_response_id``) and ``earlier`` is empty:
            that conversation is kept sealed, readable only through the audited retention API, so replay
            takes it as chat messages in the --messages-file.
    """
    from gateway.errors import InvalidRequest
    from gateway.inference.responses import to_chat
    from gateway.schemas.responses_api import ResponsesRequest

    req = ResponsesRequest.model_validate(body)
    if req.previous_response_id is not None and not earlier:
        raise ReplayError("the request continued a stored response (previous_response_id): give the "
                          "conversation it continued (its turns and replies, as chat messages) with "
                          "--messages-file and this request's body with --request-file")
    try:
        return to_chat(req, earlier, 0)
    except InvalidRequest as e:
        raise ReplayError(f"cannot read the Responses request: {e.message}") from None


def _check_template_body(record: _Record, has_body: bool) -> None:
    """A request that set chat template fields rendered its prompt with them: they are in its body.

    Raises:
        ReplayError: The record names such fields and no body was given.
    """
    from gateway.schemas.chat_template import TEMPLATE_FIELDS

    named = [f for f in record.features if f in TEMPLATE_FIELDS]
    if named and not has_body:
        raise ReplayError(f"the recorded request set {', '.join(named)}, which the chat template renders: "
                          "give its request body with --request-file (or as the --messages-file)")


def _structured(data_dir: Path, receipt: Receipt, request: Any, has_body: bool) -> Any:
    """The request's structured output, rebuilt from its body, once it matches the recorded hash.

    Raises:
        ReplayError: The record names one but no body was given, or the body cannot be read.
        typer.Exit: It differs from the recorded one (nothing is run).
    """
    from gateway.errors import GatewayError
    from gateway.inference.structured import requested_output

    try:
        # A receipt before version 3 holds no bound: its forced list of calls had none.
        structured = requested_output(request, receipt.max_tool_calls)
    except GatewayError as e:
        raise ReplayError(e.message) from None
    if structured is None and receipt.structured_kind is None:
        return None
    if structured is None and not has_body:
        raise ReplayError(
            f"the recorded request had a {receipt.structured_kind} structured output: give its request "
            "body with --request-file (a chat's --messages-file may be that body)"
        )
    if structured is not None and receipt.version < 2:
        raise ReplayError("the request's receipt was recorded before receipts held structured outputs")
    recorded, keys = receipt.structured_hash, _audit_keys(data_dir)
    if structured is None or recorded != keys.structured_hash(structured.kind, structured.spec):
        typer.echo("structured output: DIFFERS from the recorded keyed hash; not run")
        raise typer.Exit(EXIT_PROMPT_DIFFERS)
    typer.echo(f"structured output: {structured.kind} matches the recorded keyed hash")
    return structured


def _prompt_ids(settings: Any, request: Any, keep: int | None) -> list[list[int]]:
    """Each prompt's ids, as the gateway made them (a chat has one prompt), its last ``keep`` only (the
    recorded ``truncate_prompt_tokens``)."""
    from engine.runner.loader import load_tokenizer, resolve_model_dir
    from gateway.errors import GatewayError
    from gateway.inference.admission import chat_token_ids, text_token_ids
    from gateway.schemas.openai import ChatCompletionRequest

    tokenizer = load_tokenizer(resolve_model_dir(settings.model))
    try:
        if isinstance(request, ChatCompletionRequest):
            prompts = [chat_token_ids(tokenizer, request)]
        else:
            prompts = text_token_ids(tokenizer, request)
    except GatewayError as e:
        raise ReplayError(e.message) from None
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


def _is_body(messages_file: Path | None) -> bool:
    """Whether a chat's messages file is a request body (an object) rather than a list of messages."""
    return messages_file is not None and messages_file.read_bytes().lstrip()[:1] == b"{"


def _audit_keys(data_dir: Path) -> Any:
    from audit.keys import CHAIN_KEY_FILE, load_or_create_keys

    if not (data_dir / CHAIN_KEY_FILE).is_file():  # never create keys here: the hash could not match
        raise ReplayError(f"no audit keys in {data_dir}: give the gateway's --data-dir")
    return load_or_create_keys(data_dir)


def _prompt_hash(data_dir: Path, prompts: list[list[int]]) -> str:
    return _audit_keys(data_dir).prompts_hash(prompts)


def _run(settings: Any, receipt: Receipt, prompts: list[list[int]], structured: Any) -> Any:
    """The request, alone, in a fresh engine built like the server's."""
    from engine import LLMEngine
    from engine.replay import StreamItem, run_stream

    config = settings.engine_config()
    if config.num_kv_blocks is None:
        config.kv_cache_memory = _REPLAY_KV_BYTES
    try:
        engine = LLMEngine(config)
        if engine.model_name != receipt.model:
            typer.echo(f"warning: recorded model {receipt.model!r}, replaying on {engine.model_name!r}")
        prompt = prompts[0] if len(prompts) == 1 else prompts
        item = StreamItem(0, "replay", prompt, receipt.sampling_params(structured))
        return run_stream(engine, [item])["replay"], engine.determinism.fingerprints[receipt.determinism]
    except ValueError as e:  # InvalidRequestError, PromptTooLongError, ModelLoadError, bad settings
        raise ReplayError(f"the engine refused the replay: {e}") from None


def _verdict(receipt: Receipt, out: Any, fingerprint: str) -> int:
    """Print the comparison; return the exit code."""
    from engine.determinism import token_hash_chain

    same_system = fingerprint == receipt.system_fingerprint
    if same_system:
        typer.echo(f"system fingerprint: {fingerprint} matches")
    else:
        typer.echo(
            f"system fingerprint: DIFFERS: recorded {receipt.system_fingerprint}, this engine "
            f"{fingerprint} (other weights, tokenizer, engine version, dtype or kernel settings)"
        )
    # The chain is keyed by the recorded fingerprint, so equal tokens match even on another system.
    matches = []
    for o, recorded in zip(out.outputs, receipt.token_hashes, strict=False):
        ok = token_hash_chain(receipt.system_fingerprint, o.token_ids) == recorded
        matches.append(ok)
        typer.echo(
            f"choice {o.index}: {len(o.token_ids)} tokens, token hash {'matches' if ok else 'DIFFERS'}"
        )
    if len(out.outputs) != len(receipt.token_hashes) or not all(matches):
        typer.echo("REPLAY DIFFERS: the output is not the recorded one")
        if receipt.determinism == "fixed" and same_system:
            typer.echo(f"note: {_FIXED_LIMIT}")
        return EXIT_OUTPUT_DIFFERS
    if not same_system:
        typer.echo("output reproduced, but on a different system fingerprint")
        return EXIT_OTHER_SYSTEM
    typer.echo("REPLAY MATCHES")
    return EXIT_MATCH


@app.command("replay", help=_HELP)
def replay_cmd(
    record: Annotated[str, typer.Argument(help="Request id, or an audit event id of that request.")],
    prompt_file: Annotated[Path | None, typer.Option(help="The prompt of a /v1/completions request.")] = None,
    messages_file: Annotated[
        Path | None, typer.Option(help="JSON messages of a /v1/chat/completions request.")
    ] = None,
    token_ids: Annotated[bool, typer.Option(
        help="--prompt-file holds JSON: an array of token ids, or of prompts (strings or token-id arrays).")
    ] = False,
    request_file: Annotated[
        Path | None, typer.Option(help="The request body as sent (JSON): its structured output and tools.")
    ] = None,
    data_dir: DataDirOpt = None,
    db_url: DbUrlOpt = None,
    model: Annotated[str | None, typer.Option(help="Model dir or GGUF, as served (KVGATE_MODEL).")] = None,
    dtype: Annotated[str | None, typer.Option(help="As served (KVGATE_DTYPE).")] = None,
    int4_decode: Annotated[str | None, typer.Option(help="As served (KVGATE_INT4_DECODE).")] = None,
    device: Annotated[str | None, typer.Option(help="As served (KVGATE_DEVICE).")] = None,
    reserved_cpus: Annotated[
        int | None, typer.Option(help="As served (KVGATE_RESERVED_CPUS): the engine's thread count.")
    ] = None,
) -> None:
    settings = build_settings(data_dir=data_dir, db_url=db_url, model=model, dtype=dtype, device=device,
                              reserved_cpus=reserved_cpus, int4_decode=int4_decode)
    try:
        rec = run(lambda: _find_record(settings.database_url, record))
        receipt = _receipt(rec)
        typer.echo(
            f"request {rec.request_id} (event {rec.event_id}): {receipt.kind}, {receipt.determinism}, "
            f"{receipt.params.n} choice(s), max_tokens {receipt.params.max_tokens}"
        )
        request = _read_request(receipt, prompt_file, messages_file, request_file, token_ids)
        has_body = request_file is not None or (receipt.kind == "chat" and _is_body(messages_file))
        _check_template_body(rec, has_body)
        prompts = _prompt_ids(settings, request, receipt.params.truncate_prompt_tokens)
        num_tokens = sum(map(len, prompts))
        if _prompt_hash(settings.data_dir, prompts) != receipt.prompt_hash:
            typer.echo(f"prompt: DIFFERS from the recorded keyed hash ({num_tokens} tokens); not run")
            raise typer.Exit(EXIT_PROMPT_DIFFERS)
        typer.echo(f"prompt: matches the recorded keyed hash ({num_tokens} tokens)")
        structured = _structured(settings.data_dir, receipt, request, has_body)
        out, fingerprint = _run(settings, receipt, prompts, structured)
    except ReplayError as e:
        typer.echo(f"cannot replay: {e}", err=True)
        raise typer.Exit(EXIT_CANNOT_REPLAY) from None
    raise typer.Exit(_verdict(receipt, out, fingerprint))
