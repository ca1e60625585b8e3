"""Typed errors. Each carries the offending value; `http_status` maps it to an HTTP code in one place."""
from __future__ import annotations

from typing import Any


class JaxserveError(Exception):
    """Base error: `value` is the bad input, `param` names it (for OpenAI-shaped error bodies)."""

    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, value: Any = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.value = value
        self.param = param


class ConfigError(JaxserveError):
    """A model or engine config that cannot be served (unknown model_type, inconsistent dims)."""

    http_status = 400
    error_type = "invalid_config"


class CheckpointError(JaxserveError):
    """A checkpoint that cannot be read: missing tensor, wrong shape, unreadable dtype."""

    http_status = 500
    error_type = "checkpoint_error"


class InvalidRequestError(JaxserveError):
    """A request the engine refuses: bad types, out-of-range values, prompt too long."""

    http_status = 400
    error_type = "invalid_request_error"


class NotFoundError(JaxserveError):
    """A named resource (e.g. the request's `model`) that this server does not have."""

    http_status = 404
    error_type = "invalid_request_error"  # what OpenAI sends with code "model_not_found"


class PayloadTooLargeError(JaxserveError):
    """A request body over the server's limit, refused before it is read."""

    http_status = 413
    error_type = "invalid_request_error"


class UnsupportedMediaTypeError(JaxserveError):
    """A request body that is not declared as JSON (UTF-8)."""

    http_status = 415
    error_type = "invalid_request_error"


class ModelNotFoundError(NotFoundError):
    """The body names a model this server does not serve (404, as OpenAI and vLLM answer)."""

    code = "model_not_found"


class ResponseNotFoundError(NotFoundError):
    """A /v1/responses id (`previous_response_id`, GET) that was never stored, or was evicted or expired."""

    code = "response_not_found"


class ContextLengthError(InvalidRequestError):
    """prompt + max_tokens exceeds the engine's context window."""

    code = "context_length_exceeded"


class UnsupportedParameterError(InvalidRequestError):
    """A known OpenAI parameter with a value this server does not implement (n > 1, top alternatives, ...)."""

    code = "unsupported_parameter"


class MalformedBodyError(InvalidRequestError):
    """The body is not a JSON object."""

    code = "invalid_json"


class NotJsonError(UnsupportedMediaTypeError):
    """The body is not declared `application/json` (UTF-8)."""

    code = "unsupported_media_type"


class RequestAbortedError(JaxserveError):
    """The engine ended the request with finish_reason "abort" although this client is still connected."""

    http_status = 503
    error_type = "request_aborted"


class QueueFullError(JaxserveError):
    """The engine's admission queue is full; the client should retry later."""

    http_status = 429
    error_type = "rate_limit_error"


class ShuttingDownError(JaxserveError):
    """The server is draining for shutdown: it admits nothing new; the client should retry (elsewhere)."""

    http_status = 503
    error_type = "service_unavailable"


class OutOfPagesError(JaxserveError):
    """The KV page pool cannot satisfy an allocation."""

    http_status = 503
    error_type = "out_of_pages"


class PageAllocatorError(JaxserveError):
    """Allocator misuse: double free, use after free, freeing a page that is not owned."""

    http_status = 500
    error_type = "page_allocator_error"


class KVIntegrityError(JaxserveError):
    """A request's expected (page, tag) pairs no longer match the pool: the request is aborted."""

    http_status = 500
    error_type = "kv_integrity_error"


class KVTransferError(JaxserveError):
    """Moving a request's KV pages between a prefill and a decode server failed (refused, broken or timed-out
    connection, unknown transfer id, a page whose checksum differs after the copy): only that request fails."""

    http_status = 502
    error_type = "kv_transfer_error"


class BackendError(JaxserveError):
    """A server behind `jaxserve router` failed a request it was sent: unreachable, its connection closed or timed
    out mid-answer, or its answer was unusable (value: the server's URL)."""

    http_status = 502
    error_type = "backend_error"


class BackendUnreachableError(BackendError):
    """A server behind `jaxserve router` refused or timed out the connection: nothing was sent, so the router may
    send the request to another server."""


class NoBackendError(JaxserveError):
    """`jaxserve router` has no live server in a pool the request needs (value: the pool's URLs)."""

    http_status = 503
    error_type = "service_unavailable"


def http_status(error: BaseException) -> int:
    """The HTTP status code for any exception (500 for anything not typed here)."""
    return error.http_status if isinstance(error, JaxserveError) else 500
