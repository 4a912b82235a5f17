"""What a process presents to Redis and how credential files are read and written
(meridian.credentials), beside test_auth's folder layout, role table and servers."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from meridian import credentials


@pytest.fixture
def identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean slate for this process's identity: no use(), no registered address, no
    environment (each test sets what it needs)."""
    monkeypatch.setattr(credentials, "_process", credentials._UNSET)
    monkeypatch.setattr(credentials, "_by_address", {})
    monkeypatch.delenv(credentials.ENV_CREDENTIALS, raising=False)
    monkeypatch.delenv(credentials.ENV_ROLE, raising=False)


def test_credentials_without_a_role_act_as_the_operator(identity: None, credentials_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MERIDIAN_CREDENTIALS alone is how an operator's shell (meridian status, train,
    benches) is set up; it must present the operator's token, not some narrower role's."""
    monkeypatch.setenv(credentials.ENV_CREDENTIALS, str(credentials_dir))
    assert credentials.process_identity() == credentials.Identity(credentials_dir, "operator")


def test_redis_login_is_the_users_of_the_callers_role(identity: None, credentials_dir: Path) -> None:
    passwords = credentials.redis_passwords(credentials_dir)
    credentials.use(credentials.Identity(credentials_dir, "trainer"))
    assert credentials.redis_login("rediss://127.0.0.1:6379/0") == {"username": "trainer", "password": passwords["trainer"]}
    assert credentials.redis_login("redis://127.0.0.1:6379/0") == {"username": "trainer", "password": passwords["trainer"]}


@pytest.mark.parametrize(
    ("role", "url"),
    [
        ("trainer", "rediss://someone:secret@127.0.0.1:6379/0"),  # the URL's own login wins
        ("trainer", "rediss://:secret@127.0.0.1:6379/0"),  # a password alone (the default user)
        ("relay", "rediss://127.0.0.1:6379/0"),  # a role with no Redis user
        ("trainer", "http://127.0.0.1:6379/"),  # not Redis
    ],
)
def test_redis_login_adds_nothing_where_it_does_not_apply(identity: None, credentials_dir: Path, role: str, url: str) -> None:
    """A login the user wrote into the URL is theirs to keep: redis-py lays the URL's
    parts over the keywords, so with the role's login added a URL carrying a password
    alone would log in as the role's user with that password, a login nobody wrote."""
    credentials.use(credentials.Identity(credentials_dir, role))
    assert credentials.redis_login(url) == {}


def test_redis_tls_only_for_rediss_urls(identity: None, credentials_dir: Path) -> None:
    """A redis:// URL is plaintext by the user's choice; handing redis-py TLS file
    settings for it would either fail the connection or quietly turn TLS on."""
    assert credentials.redis_tls("rediss://127.0.0.1:6379/0") == {}  # no identity: the system's trust
    credentials.use(credentials.Identity(credentials_dir, "rollout"))
    assert credentials.redis_tls("redis://127.0.0.1:6379/0") == {}
    assert credentials.redis_tls("rediss://127.0.0.1:6379/0") == credentials.redis_client_tls(credentials_dir)


@pytest.mark.parametrize("name", ["tokens.json", "redis-users.json"])
def test_an_empty_secret_in_a_json_map_is_refused(tmp_path: Path, name: str) -> None:
    """An empty token or password is no secret: a Redis user with an empty password, or a
    role whose token is "", must stop the load rather than serve."""
    values = {role: f"secret-{role}" for role in (*credentials.ROLES, *credentials.REDIS_USERS)}
    values["trainer"] = ""
    (tmp_path / name).write_text(json.dumps(values))
    with pytest.raises(credentials.CredentialsError, match="non-empty strings"):
        credentials.load_tokens(tmp_path) if name == "tokens.json" else credentials.redis_passwords(tmp_path)


def test_an_unknown_role_is_named_as_such(tmp_path: Path) -> None:
    """MERIDIAN_ROLE comes from the environment: a typo must say it is no role, not send
    the user looking for a missing file."""
    credentials.make_credentials(tmp_path / "creds")
    with pytest.raises(credentials.CredentialsError, match="unknown role 'trainr'"):
        credentials.role_token(tmp_path / "creds", "trainr")
    with pytest.raises(credentials.CredentialsError, match="unknown Redis user 'relay'"):
        credentials.redis_password(tmp_path / "creds", "relay")


def test_remade_secrets_are_private_even_where_the_old_file_was_not(tmp_path: Path) -> None:
    """`meridian certs --force` over a folder whose secret someone made world-readable:
    the new secret is written to a new 0600 file, not into the old file and its mode."""
    folder = credentials.make_credentials(tmp_path / "creds")
    for name in ("tokens.json", "trainer.token", "ca-key.pem"):
        os.chmod(folder / name, 0o644)
    credentials.make_credentials(folder, overwrite=True)
    for name in ("tokens.json", "trainer.token", "ca-key.pem"):
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600, name


def test_certs_without_force_adds_files_and_rewrites_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Deployed services hold the per-role files (Kubernetes Secrets are made from them):
    completing a folder must not rewrite one from the operator's copies, even where the two
    no longer agree (a role's token replaced in its own file)."""
    from meridian.cli import main

    folder = credentials.make_credentials(tmp_path / "creds")
    (folder / "relay.token").write_text("rotated-by-hand")
    (folder / "redis-rollout.password").unlink()  # a file an earlier release did not make
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert main(["certs", "--out", str(folder)]) == 0
    assert "added redis-rollout.password" in capsys.readouterr().out
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert {name: after[name] for name in before} == before
    assert after["redis-rollout.password"].decode() == credentials.redis_passwords(folder)["rollout"]


@pytest.mark.parametrize("service", sorted(credentials.SERVICE_ROLES))
def test_a_service_calls_as_the_role_whose_token_its_secret_holds(service: str) -> None:
    """Deployments set no MERIDIAN_ROLE: a `meridian serve` process calls the others as
    SERVICE_ROLES names, with that role's token from its own Kubernetes Secret (compose
    mounts the same files). A role whose token the Secret lacks stops it at start; a
    broader one (operator) would need a token no service may hold."""
    import yaml

    kustomization = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "credentials" / "kustomization.yaml"
    secrets = {s["name"]: set(s["files"]) for s in yaml.safe_load(kustomization.read_text())["secretGenerator"]}
    held = {role for role in credentials.ROLES if credentials.token_file(role) in secrets[f"meridian-{service}-credentials"]}
    role = credentials.SERVICE_ROLES[service]
    if service == "envsandbox":
        assert held == set()  # it calls nobody: its role is never used
    else:
        assert held == {role} and role != "operator"
