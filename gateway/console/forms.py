"""Form input to the API's own request models: the console validates with the same pydantic models, and
reports every error at once (field and message) for display next to the form."""

from __future__ import annotations

from typing import Any, TypeVar

from litestar import Request
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
MAX_FIELD_CHARS = 65_536  # a policy's JSON is well under 4 KiB; anything longer is refused unread


class FormErrors(Exception):
    """Invalid form input: ``errors`` lists ``(field, message)`` pairs."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))
        self.errors = errors


def validate(model: type[M], data: dict[str, Any]) -> M:
    """``model`` from ``data``.

    Raises:
        FormErrors: Every validation error, located by dotted field path.
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise FormErrors([(".".join(str(p) for p in err["loc"]) or "(form)", err["msg"])
                          for err in e.errors(include_url=False, include_input=False)]) from None


def optional_int(value: str | None, name: str) -> int | None:
    """A form's optional integer field (blank: ``None``).

    Raises:
        FormErrors: Not a whole number.
    """
    text = (value or "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise FormErrors([(name, "must be a whole number")]) from None


async def text_fields(request: Request, *names: str) -> dict[str, str]:
    """The named text fields of a form (missing ones blank).

    Raises:
        FormErrors: A field longer than ``MAX_FIELD_CHARS``.
    """
    form = await request.form()
    fields: dict[str, str] = {}
    for name in names:
        value = form.get(name)
        text = value if isinstance(value, str) else ""
        if len(text) > MAX_FIELD_CHARS:
            raise FormErrors([(name, f"longer than {MAX_FIELD_CHARS} characters")])
        fields[name] = text
    return fields
