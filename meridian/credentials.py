"""Credentials of one Meridian deployment: made once by ``meridian certs`` (or by
``meridian up`` in its run folder), loaded by every server and client.

A credentials folder holds (private keys mode 0600)::

    ca.pem, ca-key.pem                the private CA every peer trusts
    <service>.pem, <service>-key.pem  server certificate of envsandbox, rollout, trainer,
                                      weightsync (relays use weightsync's); SAN localhost,
                                      127.0.0.1 and every --host given
    client.pem, client-key.pem        the client certificate callers present (mTLS)
    tokens.json                       role -> bearer token (trainer, rollout, relay,
                                      production, operator)
    api-keys.json                     rollout's caller classes (--caller-classes format):
                                      the production and operator tokens -> production
    redis-users.json                  Redis ACL user -> password (trainer, rollout, operator)
    redis.acl                         those users as a Redis ACL file (redis-server --aclfile)
    signing-key.pem, signing-pub.pem  the version-signing Ed25519 key pair

Only the CA's certificate, a certificate and key, and one token are what a caller from
outside Python needs: TLS trusting ``ca.pem`` with ``client.pem``/``client-key.pem`` as
its certificate, and the metadata ``authorization: Bearer <token>`` on every call.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Callers, by what they may do (the method table is in :mod:`meridian.access`).
ROLES = ("trainer", "rollout", "relay", "production", "operator")
#: Services with a server certificate of their own.
SERVICES = ("envsandbox", "rollout", "trainer", "weightsync")
#: Redis ACL users (the stream's two sides and the operator).
REDIS_USERS = ("trainer", "rollout", "operator")
#: The client role each service's own outgoing calls use (envsandbox calls nobody).
SERVICE_ROLES = {"rollout": "rollout", "trainer": "trainer", "weightsync": "relay", "envsandbox": "operator"}

ENV_CREDENTIALS = "MERIDIAN_CREDENTIALS"
ENV_ROLE = "MERIDIAN_ROLE"
TOKENS = "tokens.json"
API_KEYS = "api-keys.json"
REDIS_PASSWORDS = "redis-users.json"
REDIS_ACL_FILE = "redis.acl"
CA, CA_KEY = "ca.pem", "ca-key.pem"
CLIENT, CLIENT_KEY = "client.pem", "client-key.pem"
SIGNING_KEY, SIGNING_PUB = "signing-key.pem", "signing-pub.pem"
VALID_DAYS = 825
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class CredentialsError(ValueError):
    """A credentials folder is missing, incomplete, or does not fit the request."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address, IPv6 with or without brackets) is loopback only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cert_path(folder: Path, name: str) -> tuple[Path, Path]:
    """Certificate and key of ``name`` (a service, or ``client``)."""
    return folder / f"{name}.pem", folder / f"{name}-key.pem"


# ---------------------------------------------------------------- making


#: Redis ACL of each role's user (``meridian up`` writes them into its Redis config; compose
#: and Kubernetes mount ``redis.acl``).
#: The rollout appends groups and reads the backlog's size; the trainer creates and reads
#: its consumer group, acks, claims, and appends only to dead-letter streams; the
#: operator may do all. No user may run a command without logging in.
REDIS_ACL = {
    "operator": "~* &* +@all",
    "trainer": "~* -@all +ping +xgroup|create +xreadgroup +xack +xautoclaim +xclaim +xpending +xlen +xinfo|groups (~*:dead +xadd)",
    "rollout": "~* -@all +ping +xadd +xlen +xinfo|groups",
}


def redis_acl(passwords: Mapping[str, str]) -> str:
    """Redis ACL lines (a config file's or an ``--aclfile``'s): the default user off,
    one user per role."""
    lines = ["user default off"]
    for user, rules in REDIS_ACL.items():
        lines.append(f"user {user} on >{passwords[user]} resetchannels {rules}")
    return "\n".join(lines) + "\n"




def _write_private(path: Path, data: bytes) -> None:
    """Writes a secret readable by its owner only (created 0600, never world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Meridian"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # ordered, without repeats
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, hosts: Iterable[str] = (), usages: Iterable[x509.ObjectIdentifier] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    else:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        hosts = list(hosts)
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_credentials(out: Path, hosts: Iterable[str] = (), overwrite: bool = False) -> Path:
    """Makes a complete credentials folder at ``out`` (the layout in the module
    docstring); server certificates name ``localhost``, ``127.0.0.1`` and ``hosts``.
    Refuses to replace an existing one unless ``overwrite``; returns ``out``."""
    out = Path(out)
    if (out / TOKENS).exists() and not overwrite:
        raise CredentialsError(f"{out} already holds credentials (`meridian certs --force` replaces them)")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    names = [*LOOPBACK_NAMES[:2], *hosts]

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("Meridian CA")
    ca_cert = _certificate("Meridian CA", ca_key, ca_name, ca_key, ca=True)
    (out / CA).write_bytes(_pem(ca_cert))
    _write_private(out / CA_KEY, _key_pem(ca_key))

    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    for subject, hostnames, usages in [*((s, names, both) for s in SERVICES), ("client", (), (ExtendedKeyUsageOID.CLIENT_AUTH,))]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert_file, key_file = cert_path(out, subject)
        cert_file.write_bytes(_pem(_certificate(f"meridian-{subject}", key, ca_name, ca_key, ca=False, hosts=hostnames, usages=usages)))
        _write_private(key_file, _key_pem(key))

    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    _write_private(out / TOKENS, json.dumps(tokens, indent=2).encode())
    # Rollout's caller classes: both may generate, and both count as production traffic.
    _write_private(out / API_KEYS, json.dumps({tokens["production"]: "production", tokens["operator"]: "production"}, indent=2).encode())
    passwords = {user: secrets.token_urlsafe(32) for user in REDIS_USERS}
    _write_private(out / REDIS_PASSWORDS, json.dumps(passwords, indent=2).encode())
    _write_private(out / REDIS_ACL_FILE, redis_acl(passwords).encode())

    from services.weightsync.signing import generate_signing_key

    generate_signing_key(out / SIGNING_KEY, out / SIGNING_PUB)
    os.chmod(out / SIGNING_KEY, 0o600)
    return out


def ensure_credentials(out: Path, hosts: Iterable[str] = ()) -> Path:
    """The credentials at ``out``, made first when the folder holds none."""
    if not (Path(out) / TOKENS).exists():
        make_credentials(out, hosts)
    return Path(out)


# ---------------------------------------------------------------- loading


def _read(folder: Path, name: str) -> bytes:
    path = folder / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CredentialsError(f"credentials folder {folder}: cannot read {name} ({exc.strerror}); make one with `meridian certs --out {folder}`") from None


def _json_map(folder: Path, name: str) -> dict[str, str]:
    try:
        data = json.loads(_read(folder, name))
    except json.JSONDecodeError as exc:
        raise CredentialsError(f"{folder / name}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in data.items()):
        raise CredentialsError(f"{folder / name} must be a JSON object of non-empty strings")
    return data


def load_tokens(folder: Path) -> dict[str, str]:
    """role -> token, with every role present and every token distinct."""
    tokens = _json_map(Path(folder), TOKENS)
    missing = [r for r in ROLES if r not in tokens]
    if missing or len(set(tokens.values())) != len(tokens):
        raise CredentialsError(f"{Path(folder) / TOKENS}: needs a distinct token for each role of {list(ROLES)} (missing: {missing})")
    return tokens


def token_roles(folder: Path) -> dict[str, str]:
    """token -> role: what a server checks a caller's bearer token against."""
    return {token: role for role, token in load_tokens(folder).items()}


def role_token(folder: Path, role: str) -> str:
    """The bearer token of ``role``."""
    if role not in ROLES:
        raise CredentialsError(f"unknown role {role!r}; roles are {list(ROLES)}")
    return load_tokens(folder)[role]


def redis_password(folder: Path, user: str) -> str:
    """The Redis ACL password of ``user`` (trainer, rollout or operator)."""
    passwords = _json_map(Path(folder), REDIS_PASSWORDS)
    if user not in passwords:
        raise CredentialsError(f"{Path(folder) / REDIS_PASSWORDS} has no Redis user {user!r}")
    return passwords[user]


def redis_passwords(folder: Path) -> dict[str, str]:
    """Every Redis ACL user's password."""
    return _json_map(Path(folder), REDIS_PASSWORDS)


def server_pem(folder: Path, service: str) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, server certificate, server key) of ``service``."""
    folder = Path(folder)
    if service not in SERVICES:
        raise CredentialsError(f"no server certificate for {service!r}; services are {list(SERVICES)}")
    cert, key = cert_path(folder, service)
    return _read(folder, CA), _read(folder, cert.name), _read(folder, key.name)


def client_pem(folder: Path) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, client certificate, client key)."""
    folder = Path(folder)
    return _read(folder, CA), _read(folder, CLIENT), _read(folder, CLIENT_KEY)


def folder_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """The credentials folder named by ``MERIDIAN_CREDENTIALS`` (None when unset)."""
    value = (os.environ if environ is None else environ).get(ENV_CREDENTIALS, "")
    return Path(value) if value else None


# ---------------------------------------------------------------- this process's identity


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who this process is to the services it calls: a credentials folder and a role."""

    folder: Path
    role: str


_UNSET: Any = object()
_process: Identity | None = _UNSET
#: "host:port" -> identity for the services of a stack this process started or loaded.
_by_address: dict[str, Identity] = {}


def use(identity: Identity | None) -> None:
    """Sets this process's identity for every address without one of its own (None:
    plaintext, loopback only)."""
    global _process
    _process = identity


def register(addresses: Iterable[str], identity: Identity) -> None:
    """Calls to ``addresses`` (``host:port``, or a ``redis://`` URL) present ``identity``:
    how the process that starts or reads a stack talks to it with no setting of its own,
    while other servers it talks to keep theirs."""
    for address in addresses:
        _by_address[_endpoint(address)] = identity


def unregister(addresses: Iterable[str]) -> None:
    """Forgets ``addresses`` (their ports may be reused by other servers)."""
    for address in addresses:
        _by_address.pop(_endpoint(address), None)


def identity_for(address: str) -> Identity | None:
    """The identity to present to ``address``: its registered one, else this process's
    (:func:`use`, else ``MERIDIAN_CREDENTIALS`` with ``MERIDIAN_ROLE``, default
    operator), else None."""
    if (found := _by_address.get(_endpoint(address))) is not None:
        return found
    return process_identity()


def process_identity() -> Identity | None:
    """This process's own identity: what :func:`use` set, else ``MERIDIAN_CREDENTIALS``
    with ``MERIDIAN_ROLE`` (default operator), else None."""
    global _process
    if _process is _UNSET:
        folder = folder_from_env()
        _process = None if folder is None else Identity(folder, os.environ.get(ENV_ROLE) or "operator")
    return _process


def _endpoint(address: str) -> str:
    """``host:port`` of a gRPC target or a URL."""
    if "://" in address:
        parts = urlsplit(address)
        return f"{parts.hostname}:{parts.port}"
    return address.split("///", 1)[-1]


def redis_login(url: str) -> dict[str, str]:
    """``username``/``password`` for a Redis client of ``url``: those of the Redis user
    named like the caller's role (:func:`identity_for`); none when the URL carries its
    own, or the caller has no identity or no Redis user."""
    parts = urlsplit(url)
    identity = identity_for(url) if parts.scheme in ("redis", "rediss") else None
    if parts.username or parts.password or identity is None or identity.role not in REDIS_USERS:
        return {}
    return {"username": identity.role, "password": redis_password(identity.folder, identity.role)}


def main(argv: list[str]) -> int:
    """``meridian certs``: makes a credentials folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="meridian certs", description="Make a deployment's credentials: a private CA, server certificates, a client certificate, role tokens, API keys, Redis passwords and the version-signing key pair.")
    parser.add_argument("--out", type=Path, default=Path(".meridian/run/credentials"), help="folder to write (default: meridian up's, .meridian/run/credentials)")
    parser.add_argument("--host", action="append", default=[], help="another name or address the server certificates are valid for (repeatable; localhost and 127.0.0.1 always are)")
    parser.add_argument("--force", action="store_true", help="replace credentials already in --out (every token, key and certificate changes)")
    ns = parser.parse_args(argv)
    try:
        make_credentials(ns.out, ns.host, overwrite=ns.force)
    except CredentialsError as exc:
        parser.error(str(exc))
    print(f"credentials written to {ns.out.resolve()} (servers: --credentials {ns.out} or MERIDIAN_CREDENTIALS; clients also MERIDIAN_ROLE)")
    return 0
