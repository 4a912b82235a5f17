"""Errors a service raises on purpose, each naming the gRPC status it maps to.

Cores raise these (they carry no gRPC import); the one error boundary in
``meridian.grpc_runtime`` turns them into a status code and a message. Anything
else that escapes a handler becomes INTERNAL with a reference, never a traceback.
"""
from __future__ import annotations


class MeridianError(Exception):
    """Base class; ``status`` is the name of a ``grpc.StatusCode`` member."""

    status = "INTERNAL"


class InvalidArgument(MeridianError, ValueError):
    status = "INVALID_ARGUMENT"


class NotFound(MeridianError, LookupError):
    status = "NOT_FOUND"


class AlreadyExists(MeridianError):
    status = "ALREADY_EXISTS"


class FailedPrecondition(MeridianError):
    status = "FAILED_PRECONDITION"


class ResourceExhausted(MeridianError):
    status = "RESOURCE_EXHAUSTED"


class Unavailable(MeridianError):
    status = "UNAVAILABLE"


class Aborted(MeridianError):
    """A concurrent change got in the way (e.g. a sharded publish whose base moved); retrying can succeed."""

    status = "ABORTED"


class DeadlineExceeded(MeridianError):
    status = "DEADLINE_EXCEEDED"


class DataLoss(MeridianError):
    status = "DATA_LOSS"


class Unauthenticated(MeridianError):
    status = "UNAUTHENTICATED"
