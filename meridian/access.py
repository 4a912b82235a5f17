"""Who may call what: the role table of every gRPC method, and the decision the server
interceptor (:class:`meridian.grpc_runtime.AuthInterceptor`) applies to each call.

A caller is known by its bearer token (``authorization: Bearer <token>``), which maps to
one role (:data:`meridian.credentials.ROLES`). Servers hold only each token's SHA-256
(:func:`token_digest`), never the tokens: a service that is broken into learns no
credential it could call the others with. The operator may call everything; the
other roles only the methods listed for them here. Health and reflection answer anyone,
so probes and tools like grpcurl work without a token. A method missing from the table
is the operator's alone (new methods are closed until someone opens them here).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Mapping

OPERATOR = "operator"
#: Methods anyone may call, with or without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

#: full method name -> roles besides the operator that may call it.
METHOD_ROLES: dict[str, frozenset[str]] = {
    # weightsync: the trainer publishes; rollouts and relays follow
    "/meridian.v1.WeightSync/Publish": frozenset({"trainer"}),
    "/meridian.v1.WeightSync/Subscribe": frozenset({"rollout", "relay"}),
    "/meridian.v1.WeightSync/GetManifest": frozenset({"trainer", "rollout", "relay"}),
    "/meridian.v1.WeightSync/FetchChunk": frozenset({"rollout", "relay"}),
    "/meridian.v1.WeightSync/Status": frozenset({"trainer", "rollout", "relay"}),
    # rollout: production clients generate; RL episodes are started by the operator's jobs
    "/meridian.v1.Rollout/Generate": frozenset({"production"}),
    "/meridian.v1.Rollout/Score": frozenset({"production"}),
    "/meridian.v1.Rollout/RunEpisodes": frozenset(),
    "/meridian.v1.Rollout/Status": frozenset({"production"}),
    # trainer: its progress is the operator's (meridian train, status, benches)
    "/meridian.v1.Trainer/Status": frozenset(),
    # envsandbox: only rollout's episode workers drive sandboxes
    **{f"/meridian.v1.EnvSandbox/{m}": frozenset({"rollout"}) for m in ("ListTasks", "GetTask", "Create", "Exec", "WriteFiles", "ReadFiles", "Fork", "RunTests", "Close", "List", "Renew")},
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a call is refused: ``code`` is UNAUTHENTICATED or PERMISSION_DENIED."""

    code: str
    message: str


def bearer_token(values: list[str]) -> str | Refusal:
    """The token of a call's ``authorization`` metadata values."""
    if not values:
        return Refusal("UNAUTHENTICATED", "this call needs a token: send the metadata 'authorization: Bearer <token>'")
    if len(values) > 1:
        return Refusal("UNAUTHENTICATED", "more than one authorization value")
    scheme, _, token = values[0].partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return Refusal("UNAUTHENTICATED", "the authorization value must be 'Bearer <token>'")
    return token.strip()


def token_digest(token: str) -> str:
    """The SHA-256 of a bearer token (hex): what a server keeps in place of the token.
    Tokens are 256-bit random values, so an unsalted hash cannot be searched back."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def role_of(token: str, digest_roles: Mapping[str, str]) -> str | None:
    """The role of ``token``: its digest compared in constant time against every known
    token's digest (``digest_roles``: token digest -> role)."""
    digest = token_digest(token).encode()
    found = None
    for known, role in digest_roles.items():
        if hmac.compare_digest(known.encode(), digest):
            found = role
    return found


def allowed(role: str, method: str, table: Mapping[str, frozenset[str]] = METHOD_ROLES) -> bool:
    """Whether ``role`` may call ``method``."""
    return role == OPERATOR or role in table.get(method, frozenset())


def decide(method: str, authorization: list[str], digest_roles: Mapping[str, str]) -> Refusal | None:
    """None when the call may proceed, else why not (``digest_roles``: token digest ->
    role). The token itself never appears in a message."""
    if method.startswith(OPEN_PREFIXES):
        return None
    token = bearer_token(authorization)
    if isinstance(token, Refusal):
        return token
    role = role_of(token, digest_roles)
    if role is None:
        return Refusal("UNAUTHENTICATED", "unknown token")
    if not allowed(role, method):
        return Refusal("PERMISSION_DENIED", f"role {role!r} may not call {method}")
    return None
