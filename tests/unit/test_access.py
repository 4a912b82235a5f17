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
