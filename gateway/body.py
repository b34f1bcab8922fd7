"""Strict JSON body parsing: every malformed input becomes a 400 in OpenAI error format."""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)


def _loc(error: dict) -> str | None:
    return ".".join(str(p) for p in error.get("loc", ())) or None


def parse_body(raw: bytes, model: type[M]) -> M:
    """Decode ``raw`` as JSON (rejecting invalid UTF-8, NaN/Infinity, trailing garbage) and validate it.

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
