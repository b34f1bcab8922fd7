"""Errors raised to engine callers for bad input (all are ``ValueError``s)."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (bad prompt, bad parameters)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context or the whole KV pool."""


class ModelLoadError(ValueError):
    """The model is missing, corrupt or of an unsupported architecture."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve now: its process died or is being restarted. A retry can succeed."""
