"""The engine's typed errors; the server maps each to one gRPC status
(loom/server/grpc/status.py) and one HTTP status (loom/server/openai/errors.py)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message names the field and the limit."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (requests or queued prompt tokens); try again later."""


class EngineDeadError(RuntimeError):
    """The engine is stopped, draining or crashed; it takes no new requests."""
