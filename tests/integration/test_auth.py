"""``meridian up`` is authenticated with no step of the user's: on the real stack every
service refuses calls without a token, with a wrong one, and from a role without the
method; nothing connects without a client certificate; health answers without a token;
the OpenAI API answers 401 without a key; Redis refuses an unauthenticated PING and the
rollout user's XREADGROUP; and the stack's own commands (``meridian status``) work."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meridian import credentials
from meridian import stack as stack_mod
from meridian.grpc_runtime import ClientAuth, check_health, open_channel
from meridian.trajectory_transport import DEFAULT_CONSUMER_GROUP, DEFAULT_STREAM

pytestmark = [pytest.mark.stack, pytest.mark.engine]

#: service -> (a unary method, a role that may not call it)
CALLS = {
    "envsandbox": ("/meridian.v1.EnvSandbox/List", "trainer"),
    "weightsync": ("/meridian.v1.WeightSync/GetManifest", "production"),
    "trainer": ("/meridian.v1.Trainer/Status", "production"),
    "rollout": ("/meridian.v1.Rollout/Status", "relay"),
}
OPERATOR_CALLS = {
    "envsandbox": "/meridian.v1.EnvSandbox/List",
    "weightsync": "/meridian.v1.WeightSync/Status",
    "trainer": "/meridian.v1.Trainer/Status",
    "rollout": "/meridian.v1.Rollout/Status",
}


async def _code(address: str, method: str, auth: ClientAuth) -> grpc.StatusCode:
    async with open_channel(address, auth=auth) as channel:
        try:
            await channel.unary_unary(method)(b"", timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_every_service_of_the_stack_checks_tokens_and_roles(stack: stack_mod.Stack) -> None:
    folder = Path(stack.credentials)
    tls_only = ClientAuth.load(folder, "operator")  # its .tls: the client certificate, no token

    async def main() -> None:
        for name, (method, denied_role) in CALLS.items():
            address = stack.addresses[name]
            async with grpc.aio.secure_channel(address, tls_only.tls) as channel:
                for metadata in (None, (("authorization", "Bearer not-a-token"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await channel.unary_unary(method)(b"", metadata=metadata, timeout=30)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            assert await _code(address, method, ClientAuth.load(folder, denied_role)) == grpc.StatusCode.PERMISSION_DENIED, name
            assert await _code(address, OPERATOR_CALLS[name], ClientAuth.load(folder, "operator")) == grpc.StatusCode.OK, name
            # Without a client certificate (or in plaintext) nothing connects, health included.
            ca = (folder / "ca.pem").read_bytes()
            async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, name
            assert await check_health(address, auth=None) == "UNREACHABLE", name

    asyncio.run(main())


def test_the_openai_api_needs_a_key(stack: stack_mod.Stack) -> None:
    url = stack.addresses["rollout_http"]
    production = credentials.role_token(Path(stack.credentials), "production")
    body = {"prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{url}/completions", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{url}/completions", json=body, headers={"authorization": "Bearer wrong"}, timeout=60).status_code == 401
    assert httpx.get(f"{url}/models", headers={"authorization": f"Bearer {production}"}, timeout=60).status_code == 200


def test_the_stacks_redis_refuses_strangers_and_keeps_roles_apart(stack: stack_mod.Stack) -> None:
    passwords = credentials.redis_passwords(Path(stack.credentials))
    tls = credentials.redis_client_tls(Path(stack.credentials))
    # TLS only: without the deployment's client certificate nothing gets as far as a login.
    outsider = redis.Redis.from_url(stack.redis_url, username="rollout", password=passwords["rollout"], ssl_ca_certs=tls["ssl_ca_certs"])
    stranger = redis.Redis.from_url(stack.redis_url, **tls)
    rollout = redis.Redis.from_url(stack.redis_url, username="rollout", password=passwords["rollout"], **tls)
    try:
        with pytest.raises(redis.ConnectionError):
            outsider.ping()
        with pytest.raises(redis.AuthenticationError):
            stranger.ping()
        assert rollout.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            rollout.xreadgroup(DEFAULT_CONSUMER_GROUP, "intruder", {DEFAULT_STREAM: ">"}, count=1)
    finally:
        outsider.close()
        stranger.close()
        rollout.close()


def test_meridian_status_needs_no_step_of_the_users(stack: stack_mod.Stack) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (credentials.ENV_CREDENTIALS, credentials.ENV_ROLE)}
    out = subprocess.run(
        [sys.executable, "-m", "meridian.cli", "status", "--run-dir", str(stack.run_dir), "--json"], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    status = json.loads(out)
    for name in CALLS:
        assert status["services"][name]["health"] == "SERVING", (name, status)
    assert "policy_version" in status["services"]["trainer"] and "error" not in status["stream"], status
