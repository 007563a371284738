"""Errors the engine raises to its callers (the HTTP frontend maps them to status codes)."""


class RequestError(ValueError):
    """Bad input: the request is refused before it touches the engine. `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """Prompt (plus max_tokens) longer than the model's context or the KV pool."""


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; the caller should retry later."""


class RequestAbortedError(RuntimeError):
    """`Engine.abort` named the request while intake still held it (its grammar compiling):
    `submit` raises this instead of returning the id."""


class EngineDeadError(RuntimeError):
    """The engine stopped (fatal executor failure or shutdown); no new requests are taken."""
