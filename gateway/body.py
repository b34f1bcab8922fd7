"""Strict JSON body parsing: every malformed input becomes a 400 in OpenAI error format."""

from __future__ import annotations

from typing import TypeVar

import orjson
import structlog
from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
log = structlog.get_logger()


def _loc(error: dict) -> str | None:
    return ".".join(str(p) for p in error.get("loc", ())) or None


def parse_body(raw: bytes, model: type[M]) -> M:
    """Decode ``raw`` as JSON (rejecting invalid UTF-8, NaN/Infinity, trailing garbage) and validate it.
    Whatever fails while doing so is the body's fault: a 400, never a 500.

    Raises:
        InvalidRequest: ``code`` is ``invalid_json`` or ``invalid_value``; ``param`` names the bad field.
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"The request body is not valid JSON: {e.msg}.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    try:
        # Strict JSON mode: no "1" -> 1 coercion, but JSON arrays still fill tuple fields.
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        param = _loc(first)  # None: a rule across fields (say, stream_options without stream)
        where = f" for '{param}'" if param else ""
        raise InvalidRequest(
            f"Invalid value{where}: {first['msg']}.", code="invalid_value", param=param
        ) from None
    except Exception as e:  # noqa: BLE001  (a validator that met input it did not foresee)
        # Pydantic turns only ValueError and AssertionError into validation errors; the type goes to the
        # log, so that the validator can learn to name the field.
        log.warning("request.body_unvalidated", model=model.__name__, error_type=type(e).__name__)
        raise InvalidRequest(
            f"The request body could not be validated ({type(e).__name__}).", code="invalid_value"
        ) from None
