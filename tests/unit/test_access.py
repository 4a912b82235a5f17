"""The edges of meridian.access's decision that test_auth's role table does not reach."""
from __future__ import annotations

import pytest

from meridian import access

ROLES = {access.token_digest("t-relay"): "relay"}


@pytest.mark.parametrize("method", ["/grpc.health.v1.HealthAdmin/Reset", "/grpc.healthz/Check", "/grpc.health.v1.Health"])
def test_only_the_health_service_itself_is_open(method: str) -> None:
    """Health is open by its full service name: another service whose name merely starts
    like it (one a library registers, or a later one of ours) needs a token like the rest."""
    refusal = access.decide(method, [], ROLES)
    assert refusal is not None and refusal.code == "UNAUTHENTICATED"


def test_blanks_around_the_token_are_not_part_of_it() -> None:
    """Clients build the value by hand ("Bearer " + a token read from a file or an
    environment variable): blanks around the token must not turn a valid token into an
    unknown one, and blanks alone are no token, said as such."""
    assert access.bearer_token(["Bearer   t-relay  "]) == "t-relay"
    assert access.decide("/meridian.v1.WeightSync/Subscribe", ["Bearer  t-relay "], ROLES) is None
    refusal = access.decide("/meridian.v1.WeightSync/Subscribe", ["Bearer    "], ROLES)
    assert refusal is not None and refusal.code == "UNAUTHENTICATED" and "Bearer <token>" in refusal.message


SANDBOX_METHODS = {f"/meridian.v1.EnvSandbox/{m}" for m in ("ListTasks", "GetTask", "Create", "Exec", "WriteFiles", "ReadFiles", "Fork", "RunTests", "Close", "List", "Renew")}
FOLLOW_WEIGHTS = {f"/meridian.v1.WeightSync/{m}" for m in ("Subscribe", "GetManifest", "FetchChunk", "Status")}
#: What each role besides the operator may call, spelled out: the table is the
#: deployment's security policy, and the other tests read it rather than check it.
POLICY = {
    # The one writer of weights: nothing else may publish a version every rollout serves.
    "trainer": {"/meridian.v1.WeightSync/Publish", "/meridian.v1.WeightSync/GetManifest", "/meridian.v1.WeightSync/Status"},
    # Sandboxes run model-written code: only rollout's episode workers drive them.
    "rollout": FOLLOW_WEIGHTS | SANDBOX_METHODS,
    "relay": FOLLOW_WEIGHTS,
    # Production callers reach the generation API and nothing behind it.
    "production": {"/meridian.v1.Rollout/Generate", "/meridian.v1.Rollout/Score", "/meridian.v1.Rollout/Status"},
}


@pytest.mark.parametrize("role", sorted(POLICY))
def test_each_role_may_call_exactly_its_methods(role: str) -> None:
    """Widening a role (a relay that may publish, production reaching sandboxes or weight
    chunks) must be a decision made here, not a line slipped into the table."""
    assert {method for method in access.METHOD_ROLES if access.allowed(role, method)} == POLICY[role]
