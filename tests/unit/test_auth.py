"""Authentication: the credentials ``meridian certs`` makes, the role table, and every
service's gRPC methods behind mTLS and the token/role interceptor (real in-process
servers on loopback, conftest ``serving`` with ``secure``); the OpenAI API's key; the
Redis ACL users ``meridian up`` configures."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meridian import access, credentials
from meridian.cli import SERVICES
from meridian.grpc_runtime import ClientAuth, ServerConfig, check_health, open_channel
from tests.unit.test_server_bounds import BareService
from tests.unit.test_server_bounds import rollout as _rollout_fixture  # noqa: F401 - a fixture (a rollout on a fake engine)

T = TypeVar("T")
Serving = Callable[..., Any]
EMPTY = b""  # every request message of every method parses from no bytes
#: A call that reached the bare servicer's handler: it raises NotImplementedError, which
#: the error boundary answers INTERNAL.
REACHED = grpc.StatusCode.INTERNAL


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60.0)

    return asyncio.run(bounded())


# ---------------------------------------------------------------- credentials


def test_certs_makes_the_whole_folder_with_private_files_private(tmp_path: Path) -> None:
    folder = credentials.make_credentials(tmp_path / "creds", hosts=["10.1.2.3", "meridian.internal"])
    names = {p.name for p in folder.iterdir()}
    role_files = {credentials.token_file(r) for r in credentials.ROLES} | {credentials.redis_password_file(u) for u in credentials.REDIS_USERS}
    assert {"ca.pem", "ca-key.pem", "client.pem", "client-key.pem", "tokens.json", "token-hashes.json", "api-keys.json", "redis-users.json", "redis.acl", "signing-key.pem", "signing-pub.pem"} | role_files <= names
    for service in (*credentials.SERVICES, credentials.REDIS_SERVER):
        assert {f"{service}.pem", f"{service}-key.pem"} <= names
    for secret in ("ca-key.pem", "client-key.pem", "rollout-key.pem", "redis-key.pem", "tokens.json", "api-keys.json", "redis-users.json", "redis.acl", "signing-key.pem", *role_files):
        assert stat.S_IMODE(os.stat(folder / secret).st_mode) == 0o600, secret
    tokens = credentials.load_tokens(folder)
    assert set(tokens) == set(credentials.ROLES) and len(set(tokens.values())) == len(tokens)
    assert {role: credentials.role_token(folder, role) for role in credentials.ROLES} == tokens
    assert {role: (folder / credentials.token_file(role)).read_text() for role in credentials.ROLES} == tokens
    assert credentials.token_digests(folder) == {access.token_digest(token): role for role, token in tokens.items()}
    keys = json.loads((folder / "api-keys.json").read_text())
    assert keys == {f"sha256:{access.token_digest(tokens['production'])}": "production", f"sha256:{access.token_digest(tokens['operator'])}": "production"}
    passwords = credentials.redis_passwords(folder)
    assert set(passwords) == set(credentials.REDIS_USERS)
    assert {user: credentials.redis_password(folder, user) for user in credentials.REDIS_USERS} == passwords
    acl = (folder / "redis.acl").read_text()
    assert acl == credentials.redis_acl(passwords) and not any(password in acl for password in passwords.values())
    assert isinstance(load_pem_private_key((folder / "signing-key.pem").read_bytes(), None), Ed25519PrivateKey)

    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate((folder / "weightsync.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "meridian.internal"}
    with pytest.raises(credentials.CredentialsError, match="already holds"):
        credentials.make_credentials(folder)


def test_meridian_certs_makes_a_folder_and_keeps_an_existing_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from meridian.cli import main

    out = tmp_path / "creds"
    assert main(["certs", "--out", str(out), "--host", "rollout"]) == 0
    tokens = (out / "tokens.json").read_bytes()
    assert main(["certs", "--out", str(out)]) == 0
    assert "nothing missing" in capsys.readouterr().out and (out / "tokens.json").read_bytes() == tokens
    # A folder of an earlier release, without Redis's certificate: completed, secrets kept.
    for name in credentials.cert_path(out, credentials.REDIS_SERVER):
        name.unlink()
    assert main(["certs", "--out", str(out)]) == 0
    assert "added redis-key.pem, redis.pem" in capsys.readouterr().out and (out / "tokens.json").read_bytes() == tokens
    san = x509.load_pem_x509_certificate((out / "redis.pem").read_bytes()).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "rollout" in san.get_values_for_type(x509.DNSName)
    assert main(["certs", "--out", str(out), "--force"]) == 0
    assert (out / "tokens.json").read_bytes() != tokens


def test_a_folder_made_before_per_role_files_gets_them_and_still_serves(tmp_path: Path) -> None:
    """A run folder of an earlier release (one file of all tokens, one of all Redis
    passwords, no Redis certificate) still loads, and ``meridian up``'s ensure step adds
    the per-role files and a Redis certificate from its CA, for its services' names."""
    folder = credentials.make_credentials(tmp_path / "creds", hosts=["10.1.2.3"])
    tokens, passwords = credentials.load_tokens(folder), credentials.redis_passwords(folder)
    digests = credentials.token_digests(folder)
    redis_cert, redis_key = credentials.cert_path(folder, credentials.REDIS_SERVER)
    for name in [credentials.TOKEN_HASHES, *map(credentials.token_file, credentials.ROLES), *map(credentials.redis_password_file, credentials.REDIS_USERS), redis_cert.name, redis_key.name]:
        (folder / name).unlink()
    assert credentials.token_digests(folder) == digests and credentials.role_token(folder, "relay") == tokens["relay"]
    assert credentials.redis_password(folder, "trainer") == passwords["trainer"]
    credentials.ensure_credentials(folder)
    assert (folder / "relay.token").read_text() == tokens["relay"] and (folder / "redis-trainer.password").read_text() == passwords["trainer"]
    cert = x509.load_pem_x509_certificate(redis_cert.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes()))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.1.2.3"}
    assert stat.S_IMODE(os.stat(redis_key).st_mode) == 0o600
    (folder / "tokens.json").unlink()
    assert credentials.token_digests(folder) == digests


def test_an_incomplete_folder_is_refused_with_the_command_that_makes_one(tmp_path: Path) -> None:
    with pytest.raises(credentials.CredentialsError, match="meridian certs"):
        credentials.client_pem(tmp_path)
    with pytest.raises(credentials.CredentialsError, match=r"token-hashes.json.*meridian certs"):
        credentials.token_digests(tmp_path)
    with pytest.raises(credentials.CredentialsError, match=r"relay.token.*meridian certs"):
        credentials.role_token(tmp_path, "relay")
    (tmp_path / "tokens.json").write_text(json.dumps({"operator": "x"}))
    with pytest.raises(credentials.CredentialsError, match="distinct value for each role"):
        credentials.load_tokens(tmp_path)
    (tmp_path / "token-hashes.json").write_text(json.dumps({role: "x" for role in credentials.ROLES}))
    with pytest.raises(credentials.CredentialsError, match="distinct value for each role"):
        credentials.token_digests(tmp_path)
    (tmp_path / "token-hashes.json").write_text(json.dumps({role: role * 3 for role in credentials.ROLES}))
    with pytest.raises(credentials.CredentialsError, match="not SHA-256 digests"):
        credentials.token_digests(tmp_path)
    (tmp_path / "relay.token").write_text("\n")
    with pytest.raises(credentials.CredentialsError, match="relay.token is empty"):
        credentials.role_token(tmp_path, "relay")


# ---------------------------------------------------------------- the role table


def test_the_role_table_decides_each_call() -> None:
    tokens = {"t-trainer": "trainer", "t-rollout": "rollout", "t-relay": "relay", "t-prod": "production", "t-op": "operator"}
    roles = {access.token_digest(token): role for token, role in tokens.items()}  # what a server holds
    publish, subscribe, generate = "/meridian.v1.WeightSync/Publish", "/meridian.v1.WeightSync/Subscribe", "/meridian.v1.Rollout/Generate"
    assert access.decide(publish, ["Bearer t-trainer"], roles) is None
    assert access.decide(subscribe, ["Bearer t-relay"], roles) is None
    assert access.decide(generate, ["bearer t-prod"], roles) is None
    assert access.decide("/meridian.v1.New/Method", ["Bearer t-op"], roles) is None  # the operator may do all
    assert access.decide("/grpc.health.v1.Health/Check", [], roles) is None
    assert access.decide("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", [], roles) is None
    for values in ([], ["Bearer nope"], ["t-trainer"], ["Basic t-trainer"], ["Bearer t-trainer", "Bearer t-op"]):
        refusal = access.decide(publish, values, roles)
        assert refusal is not None and refusal.code == "UNAUTHENTICATED", values
        assert "t-" not in refusal.message  # no token is echoed
    for token, method in (("t-rollout", publish), ("t-prod", publish), ("t-trainer", generate), ("t-relay", "/meridian.v1.EnvSandbox/Exec"), ("t-prod", "/meridian.v1.New/Method")):
        refusal = access.decide(method, [f"Bearer {token}"], roles)
        assert refusal is not None and refusal.code == "PERMISSION_DENIED", (token, method)
    assert all(method.startswith("/meridian.v1.") for method in access.METHOD_ROLES)


def test_every_rpc_of_every_proto_is_in_the_role_table() -> None:
    for name in SERVICES:
        bare = BareService(name)
        for method in bare.descriptor.methods:
            assert f"/{bare.descriptor.full_name}/{method.name}" in access.METHOD_ROLES, method.full_name


# ---------------------------------------------------------------- settings


def test_plaintext_is_refused_on_non_loopback_addresses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only loopback"):
        ServerConfig(host="0.0.0.0", insecure=True)
    assert ServerConfig(host="127.0.0.1", insecure=True).credentials_folder() is None
    monkeypatch.delenv(credentials.ENV_CREDENTIALS, raising=False)
    with pytest.raises(ValueError, match="no credentials"):
        ServerConfig().credentials_folder()
    monkeypatch.setenv(credentials.ENV_CREDENTIALS, str(tmp_path))
    assert ServerConfig().credentials_folder() == tmp_path
    with pytest.raises(ValueError, match="only loopback"):
        open_channel("10.0.0.7:50051", auth=None)
    assert credentials.is_loopback("[::1]") and credentials.is_loopback("localhost") and not credentials.is_loopback("0.0.0.0")


# ---------------------------------------------------------------- every service, every method


async def _call(channel: grpc.aio.Channel, path: str, streaming: bool, metadata: tuple[tuple[str, str], ...] | None) -> grpc.StatusCode:
    """The status one call with empty request bytes ends with."""
    try:
        if streaming:
            async for _ in channel.unary_stream(path)(EMPTY, metadata=metadata, timeout=10):
                pass
        else:
            await channel.unary_unary(path)(EMPTY, metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _tls_only(folder: Path) -> grpc.ChannelCredentials:
    ca, cert, key = credentials.client_pem(folder)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_method_needs_a_token_of_a_role_that_may_call_it(service: str, grpc_serving: Serving, credentials_dir: Path) -> None:
    """No token, a wrong token: UNAUTHENTICATED; a role without the method:
    PERMISSION_DENIED; a role with it (and the operator) reach the handler (the bare
    servicer's handler); health answers without a token."""
    bare = BareService(service)
    tokens = credentials.load_tokens(credentials_dir)

    async def main() -> None:
        async with grpc_serving(bare, secure=(service, credentials_dir)) as address, grpc.aio.secure_channel(address, _tls_only(credentials_dir)) as channel:
            checked = 0
            for method in bare.descriptor.methods:
                path = f"/{bare.descriptor.full_name}/{method.name}"
                if method.client_streaming:  # weightsync's Publish: the same interceptor, a stream request
                    call = channel.stream_unary(path)
                    for metadata, want in ((None, grpc.StatusCode.UNAUTHENTICATED), ((("authorization", f"Bearer {tokens['rollout']}"),), grpc.StatusCode.PERMISSION_DENIED)):
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            await call(iter([EMPTY]), metadata=metadata, timeout=10)
                        assert info.value.code() == want
                    continue
                streaming = method.server_streaming
                allowed = access.METHOD_ROLES[path]
                assert await _call(channel, path, streaming, None) == grpc.StatusCode.UNAUTHENTICATED, path
                assert await _call(channel, path, streaming, (("authorization", "Bearer not-a-token"),)) == grpc.StatusCode.UNAUTHENTICATED, path
                assert await _call(channel, path, streaming, (("authorization", tokens["operator"]),)) == grpc.StatusCode.UNAUTHENTICATED, path
                for role in credentials.ROLES:
                    got = await _call(channel, path, streaming, (("authorization", f"Bearer {tokens[role]}"),))
                    want = REACHED if role == "operator" or role in allowed else grpc.StatusCode.PERMISSION_DENIED
                    assert got == want, (path, role)
                checked += 1
            assert checked
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(main())


#: Each Kubernetes Secret (deploy/k8s/credentials, which compose mounts alike) -> the
#: service it serves, and the role its process calls the others as (None: calls nobody).
SECRET_ROLES = {"meridian-rollout-credentials": ("rollout", "rollout"), "meridian-weightsync-credentials": ("weightsync", "relay"),
                "meridian-trainer-credentials": ("trainer", "trainer"), "meridian-envsandbox-credentials": ("envsandbox", None), "meridian-redis-credentials": (None, None)}


def _secret_folders(credentials_dir: Path, out: Path) -> dict[str, Path]:
    """One folder per Kubernetes Secret holding just that Secret's files."""
    import yaml

    kustomization = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "credentials" / "kustomization.yaml"
    folders = {}
    for secret in yaml.safe_load(kustomization.read_text())["secretGenerator"]:
        folder = out / secret["name"]
        folder.mkdir()
        for name in secret["files"]:
            shutil.copy(credentials_dir / name, folder / name)
        folders[secret["name"]] = folder
    assert set(folders) == set(SECRET_ROLES)
    return folders


def test_a_service_holds_no_secret_of_another_role(credentials_dir: Path, tmp_path: Path) -> None:
    """A service that is broken into (the envsandbox host runs model code) learns no
    token or Redis password but its own role's: no file of its Secret holds one, in any
    encoding the services read."""
    tokens = credentials.load_tokens(credentials_dir)
    passwords = credentials.redis_passwords(credentials_dir)
    for name, folder in _secret_folders(credentials_dir, tmp_path).items():
        _, role = SECRET_ROLES[name]
        held = b"".join(path.read_bytes() for path in folder.iterdir())
        for other, token in tokens.items():
            assert (token.encode() in held) == (other == role), (name, f"token of {other}")
        for user, password in passwords.items():
            assert (password.encode() in held) == (user == role), (name, f"Redis password of {user}")


@pytest.mark.parametrize("secret", ["meridian-rollout-credentials", "meridian-weightsync-credentials", "meridian-trainer-credentials", "meridian-envsandbox-credentials"])
def test_a_services_secret_alone_serves_and_calls(secret: str, grpc_serving: Serving, credentials_dir: Path, tmp_path: Path) -> None:
    """A server given only its Secret checks callers against the tokens' hashes (every
    role decided as with the whole folder), and its process calls the others with its
    own role's token."""
    folder = _secret_folders(credentials_dir, tmp_path)[secret]
    service, role = SECRET_ROLES[secret]
    bare = BareService(service)
    tokens = credentials.load_tokens(credentials_dir)
    method = next(m for m in bare.descriptor.methods if not m.client_streaming and not m.server_streaming)
    path = f"/{bare.descriptor.full_name}/{method.name}"

    async def main() -> None:
        async with grpc_serving(bare, secure=(service, folder)) as address:
            async with grpc.aio.secure_channel(address, _tls_only(credentials_dir)) as channel:
                for caller, token in tokens.items():
                    want = REACHED if caller == "operator" or caller in access.METHOD_ROLES[path] else grpc.StatusCode.PERMISSION_DENIED
                    assert await _call(channel, path, False, (("authorization", f"Bearer {token}"),)) == want, caller
                assert await _call(channel, path, False, (("authorization", "Bearer not-a-token"),)) == grpc.StatusCode.UNAUTHENTICATED
            if role is not None:
                own = ClientAuth.load(folder, role)
                assert own.token == tokens[role]
                async with open_channel(address, auth=own) as channel:
                    want = REACHED if role in access.METHOD_ROLES[path] else grpc.StatusCode.PERMISSION_DENIED
                    assert await _call(channel, path, False, None) == want

    run(main())


def test_only_clients_with_a_certificate_of_the_ca_connect(grpc_serving: Serving, credentials_dir: Path, tmp_path: Path) -> None:
    """Without a client certificate, with one of another CA, or in plaintext: no
    connection, not even for health; the deployment's own: health and calls answer."""
    bare = BareService("weightsync")
    other = credentials.make_credentials(tmp_path / "other")
    ca = (credentials_dir / "ca.pem").read_bytes()
    _, other_cert, other_key = credentials.client_pem(other)

    async def health(channel: grpc.aio.Channel) -> grpc.StatusCode:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def main() -> None:
        async with grpc_serving(bare, secure=("weightsync", credentials_dir)) as address:
            for creds in (grpc.ssl_channel_credentials(root_certificates=ca), grpc.ssl_channel_credentials(root_certificates=ca, private_key=other_key, certificate_chain=other_cert)):
                async with grpc.aio.secure_channel(address, creds) as channel:
                    assert await health(channel) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(address) as channel:
                assert await health(channel) == grpc.StatusCode.UNAVAILABLE
            assert await check_health(address, auth=None) == "UNREACHABLE"
            # The deployment's client certificate, no token: health only.
            assert await check_health(address, auth=ClientAuth.load(credentials_dir, "relay")) == "SERVING"
            async with open_channel(address, auth=ClientAuth.load(credentials_dir, "relay")) as channel:
                assert await _call(channel, "/meridian.v1.WeightSync/Status", False, None) == REACHED

    run(main())


def test_a_process_identity_applies_to_addresses_without_their_own(credentials_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(credentials, "_process", credentials._UNSET)
    monkeypatch.setattr(credentials, "_by_address", {})
    monkeypatch.setenv(credentials.ENV_CREDENTIALS, str(credentials_dir))
    monkeypatch.setenv(credentials.ENV_ROLE, "trainer")
    assert credentials.identity_for("127.0.0.1:1") == credentials.Identity(credentials_dir, "trainer")
    stack_identity = credentials.Identity(credentials_dir, "operator")
    credentials.register(["127.0.0.1:2", "redis://127.0.0.1:3/0"], stack_identity)
    assert credentials.identity_for("127.0.0.1:2") == stack_identity
    assert credentials.identity_for("redis://127.0.0.1:3/0") == stack_identity
    credentials.unregister(["127.0.0.1:2"])
    assert credentials.identity_for("127.0.0.1:2").role == "trainer"  # type: ignore[union-attr]


# ---------------------------------------------------------------- rollout's API keys


def test_rollout_with_credentials_needs_a_key_on_both_front_doors(request: pytest.FixtureRequest, grpc_serving: Serving, credentials_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The OpenAI API answers 401 without a key or with a wrong one (or another role's
    token) and serves the production key; a key of the rollout's own key file is a gRPC
    caller too, and its traffic class still comes from that file."""
    import httpx

    from meridian.v1 import rollout_pb2 as ro
    from meridian.v1 import rollout_pb2_grpc as ro_grpc

    monkeypatch.setattr(credentials, "_process", credentials.Identity(credentials_dir, "rollout"))
    tokens = credentials.load_tokens(credentials_dir)
    keys = tmp_path / "caller-classes.json"
    keys.write_text(json.dumps({"batch-eval-key": "rl"}))
    prompt = {"prompt": "def f():", "max_tokens": 1}

    async def main() -> None:
        service = request.getfixturevalue("_rollout_fixture")()
        # With credentials, the credentials' keys are its callers, and are gRPC callers too.
        assert set(service.caller_roles) == {access.token_digest(tokens["production"]), access.token_digest(tokens["operator"])}
        service.callers = type(service.callers).authenticated(credentials_dir, str(keys))
        service.caller_roles = {digest: "production" for digest in service.callers.digests()}
        async with grpc_serving(service, secure=("rollout", credentials_dir)) as address, httpx.AsyncClient(base_url=f"http://127.0.0.1:{service._http.port}/v1", timeout=30) as http:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": tokens["production"]}, {"authorization": f"Bearer {tokens['trainer']}"}):
                reply = await http.post("/completions", json=prompt, headers=headers)
                assert reply.status_code == 401, headers
                assert reply.json()["error"]["type"] and tokens["trainer"] not in reply.text
            for key in (tokens["production"], tokens["operator"], "batch-eval-key"):
                reply = await http.post("/completions", json=prompt, headers={"authorization": f"Bearer {key}"})
                assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "x"

            async def generate(key: str) -> grpc.StatusCode:
                async with open_channel(address, auth=ClientAuth.load(credentials_dir, "production", token=key)) as channel:
                    try:
                        [chunk] = [c async for c in ro_grpc.RolloutStub(channel).Generate(ro.GenerateRequest(prompt_token_ids=[1, 2]), timeout=10)]
                    except grpc.aio.AioRpcError as exc:
                        return exc.code()
                    assert chunk.token_ids == [7]
                    return grpc.StatusCode.OK

            assert await generate(tokens["production"]) == grpc.StatusCode.OK
            assert await generate("batch-eval-key") == grpc.StatusCode.OK
            assert await generate(tokens["relay"]) == grpc.StatusCode.PERMISSION_DENIED
            assert await generate("wrong") == grpc.StatusCode.UNAUTHENTICATED

    run(main())


def test_the_http_api_refuses_plaintext_off_loopback(credentials_dir: Path) -> None:
    from services.rollout.openai_api import http_tls

    assert http_tls("127.0.0.1", None) is None
    with pytest.raises(ValueError, match="only loopback"):
        http_tls("0.0.0.0", None)
    assert http_tls("0.0.0.0", credentials.Identity(credentials_dir, "rollout")) == credentials.cert_path(credentials_dir, "rollout")


# ---------------------------------------------------------------- Redis ACL


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (deploy/install.sh installs it)")
def test_local_stack_redis_has_one_acl_user_per_role(tmp_path: Path, pick_port: Callable[[], int], credentials_dir: Path) -> None:
    """``meridian up``'s Redis: TLS only, to clients with the deployment's certificate;
    no unauthenticated command (not even PING); the rollout user may XADD but not read
    the group; the trainer reads, acks and claims, and may dead-letter; the operator may
    do all."""
    import redis

    from meridian import stack
    from meridian.trajectory_transport import DEFAULT_CONSUMER_GROUP, DEFAULT_STREAM, DEAD_LETTER_SUFFIX

    passwords = credentials.redis_passwords(credentials_dir)
    proc, url = stack._start_redis(tmp_path, "127.0.0.1", pick_port(), dict(os.environ), credentials_dir)
    tls = credentials.redis_client_tls(credentials_dir)
    clients: list[redis.Redis] = []

    def as_user(user: str | None, **options: str) -> redis.Redis:
        client = redis.Redis.from_url(url, username=user, password=passwords[user] if user else None, **(options or tls))
        clients.append(client)
        return client

    try:
        assert url.startswith("rediss://")
        # In plaintext, or without the client certificate, nothing gets as far as a login.
        plaintext = redis.Redis.from_url(url.replace("rediss://", "redis://"), username="operator", password=passwords["operator"], socket_timeout=5)
        clients.append(plaintext)
        with pytest.raises(redis.ConnectionError):
            plaintext.ping()
        with pytest.raises(redis.ConnectionError):
            as_user("operator", ssl_ca_certs=tls["ssl_ca_certs"]).ping()
        with pytest.raises(redis.AuthenticationError):
            as_user(None).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url, username="rollout", password="wrong", **tls).ping()
        rollout, trainer, operator = as_user("rollout"), as_user("trainer"), as_user("operator")
        trainer.xgroup_create(DEFAULT_STREAM, DEFAULT_CONSUMER_GROUP, id="0", mkstream=True)
        assert rollout.xadd(DEFAULT_STREAM, {"group": b"x"})
        assert rollout.xlen(DEFAULT_STREAM) == 1 and rollout.xinfo_groups(DEFAULT_STREAM)
        for forbidden in (
            lambda: rollout.xreadgroup(DEFAULT_CONSUMER_GROUP, "c", {DEFAULT_STREAM: ">"}, count=1),
            lambda: rollout.xack(DEFAULT_STREAM, DEFAULT_CONSUMER_GROUP, "0-1"),
            lambda: rollout.xdel(DEFAULT_STREAM, "0-1"),
            lambda: rollout.flushall(),
            lambda: trainer.xadd(DEFAULT_STREAM, {"group": b"forged"}),
            lambda: trainer.config_get("appendfsync"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
        [[_, entries]] = trainer.xreadgroup(DEFAULT_CONSUMER_GROUP, "c", {DEFAULT_STREAM: ">"}, count=1)
        assert trainer.xautoclaim(DEFAULT_STREAM, DEFAULT_CONSUMER_GROUP, "d", 0)
        assert trainer.xadd(DEFAULT_STREAM + DEAD_LETTER_SUFFIX, {"error": b"poison"})
        assert trainer.xack(DEFAULT_STREAM, DEFAULT_CONSUMER_GROUP, entries[0][0]) == 1
        assert operator.config_get("appendfsync") == {"appendfsync": "always"}
    finally:
        for client in clients:
            client.close()
        stack._terminate(proc.pid, 10.0)
