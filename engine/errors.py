"""Errors raised to engine callers: bad input (``ValueError``s), and an engine that failed a request."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (bad prompt, bad parameters)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or of the wrong type."""


class StructuredOutputError(InvalidRequestError):
    """A structured-output spec is malformed, too large, or one the grammar library cannot compile."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context or the whole KV pool."""


class ModelLoadError(ValueError):
    """The model is missing, corrupt or of an unsupported architecture."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve now: its process died or is being restarted. A retry can succeed."""


class RequestFailedError(RuntimeError):
    """A step the request was part of failed: the request ended there, while the engine serves on."""


class StepError(RuntimeError):
    """A step failed some of its requests, and only those: they are gone and their blocks are free.

    Attributes:
        deltas: What the step's other requests produced.
        failed: Each failed request's id and the error its caller gets.
        is_total: Every request the step ran failed.
    """

    def __init__(self, deltas: list, failed: dict[str, BaseException], *, is_total: bool) -> None:
        super().__init__(f"an engine step failed {len(failed)} request(s)")
        self.deltas = deltas
        self.failed = failed
        self.is_total = is_total
