"""Credentials of one Meridian deployment: made once by ``meridian certs`` (or by
``meridian up`` in its run folder), loaded by every server and client.

A credentials folder holds (private keys mode 0600)::

    ca.pem, ca-key.pem                the private CA every peer trusts
    <service>.pem, <service>-key.pem  server certificate of envsandbox, rollout, trainer,
                                      weightsync (relays use weightsync's); SAN localhost,
                                      127.0.0.1 and every --host given
    client.pem, client-key.pem        the client certificate callers present (mTLS)
    redis.pem, redis-key.pem          Redis's server certificate (its clients present
                                      client.pem), SAN as the services'
    tokens.json                       role -> bearer token (trainer, rollout, relay,
                                      production, operator): the operator's copy of all
    <role>.token                      that role's token alone (what a process of the role
                                      presents)
    token-hashes.json                 role -> SHA-256 of its token (what servers check
                                      callers against; no token in it)
    api-keys.json                     rollout's caller classes (--caller-classes format):
                                      the production and operator tokens' SHA-256 -> production
    redis-users.json                  Redis ACL user -> password (trainer, rollout,
                                      operator): the operator's copy of all
    redis-<user>.password             that Redis user's password alone
    redis.acl                         those users as a Redis ACL file (redis-server
                                      --aclfile), with the passwords' SHA-256 only
    signing-key.pem, signing-pub.pem  the version-signing Ed25519 key pair

A service's process needs only its own role's files (see the Kubernetes Secrets in
``deploy/k8s/credentials``): a service that is broken into holds no other role's token
or password. Only the CA's certificate, a certificate and key, and one token are what a
caller from outside Python needs: TLS trusting ``ca.pem`` with ``client.pem``/
``client-key.pem`` as its certificate, and the metadata ``authorization: Bearer <token>``
on every call.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
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

from meridian.access import token_digest

#: Callers, by what they may do (the method table is in :mod:`meridian.access`).
ROLES = ("trainer", "rollout", "relay", "production", "operator")
#: Services with a server certificate of their own.
SERVICES = ("envsandbox", "rollout", "trainer", "weightsync")
#: Redis ACL users (the stream's two sides and the operator).
REDIS_USERS = ("trainer", "rollout", "operator")
#: Redis's server certificate (``redis.pem``): Redis speaks TLS to clients that present
#: the client certificate, as every other server of a deployment does.
REDIS_SERVER = "redis"
#: The client role each service's own outgoing calls use (envsandbox calls nobody).
SERVICE_ROLES = {"rollout": "rollout", "trainer": "trainer", "weightsync": "relay", "envsandbox": "operator"}

#: Marks a key of ``api-keys.json`` (or of a --caller-classes file) given as its SHA-256.
DIGEST_PREFIX = "sha256:"

ENV_CREDENTIALS = "MERIDIAN_CREDENTIALS"
ENV_ROLE = "MERIDIAN_ROLE"
TOKENS = "tokens.json"
TOKEN_HASHES = "token-hashes.json"
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


def token_file(role: str) -> str:
    """The file holding ``role``'s token alone."""
    return f"{role}.token"


def redis_password_file(user: str) -> str:
    """The file holding Redis user ``user``'s password alone."""
    return f"redis-{user}.password"


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
    one user per role, each with its password's SHA-256 (``#``), which is all Redis needs
    to check a login: the file holds no password."""
    lines = ["user default off"]
    for user, rules in REDIS_ACL.items():
        digest = hashlib.sha256(passwords[user].encode()).hexdigest()
        lines.append(f"user {user} on #{digest} resetchannels {rules}")
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
    for subject, hostnames, usages in [
        *((s, names, both) for s in SERVICES),
        (REDIS_SERVER, names, (ExtendedKeyUsageOID.SERVER_AUTH,)),
        ("client", (), (ExtendedKeyUsageOID.CLIENT_AUTH,)),
    ]:
        _write_cert(out, subject, hostnames, usages, ca_name, ca_key)

    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    _write_private(out / TOKENS, json.dumps(tokens, indent=2).encode())
    # Rollout's caller classes: both may generate, and both count as production traffic.
    api_keys = {f"{DIGEST_PREFIX}{token_digest(tokens[role])}": "production" for role in ("production", "operator")}
    _write_private(out / API_KEYS, json.dumps(api_keys, indent=2).encode())
    passwords = {user: secrets.token_urlsafe(32) for user in REDIS_USERS}
    _write_private(out / REDIS_PASSWORDS, json.dumps(passwords, indent=2).encode())
    _write_private(out / REDIS_ACL_FILE, redis_acl(passwords).encode())
    _write_per_role(out, tokens, passwords, replace=True)

    from services.weightsync.signing import generate_signing_key

    generate_signing_key(out / SIGNING_KEY, out / SIGNING_PUB)
    os.chmod(out / SIGNING_KEY, 0o600)
    return out


def _write_cert(out: Path, subject: str, hosts: Iterable[str], usages: Iterable[x509.ObjectIdentifier], ca_name: x509.Name, ca_key: Any) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    cert_file, key_file = cert_path(out, subject)
    cert_file.write_bytes(_pem(_certificate(f"meridian-{subject}", key, ca_name, ca_key, ca=False, hosts=hosts, usages=usages)))
    _write_private(key_file, _key_pem(key))


def _ensure_redis_cert(out: Path) -> None:
    """Redis's certificate for a folder made before Redis spoke TLS: signed by its CA, for
    the names its services' certificates hold."""
    if cert_path(out, REDIS_SERVER)[0].exists():
        return
    ca = x509.load_pem_x509_certificate(_read(out, CA))
    ca_key = serialization.load_pem_private_key(_read(out, CA_KEY), password=None)
    service = x509.load_pem_x509_certificate(_read(out, cert_path(out, SERVICES[0])[0].name))
    san = service.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = [*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress))]
    _write_cert(out, REDIS_SERVER, hosts, (ExtendedKeyUsageOID.SERVER_AUTH,), ca.subject, ca_key)


def _write_per_role(out: Path, tokens: Mapping[str, str], passwords: Mapping[str, str], *, replace: bool) -> None:
    """Each role's token and each Redis user's password in a file of its own, and the
    tokens' hashes; ``replace`` False keeps the files already there."""
    secrets_by_file = {token_file(r): t for r, t in tokens.items()} | {redis_password_file(u): p for u, p in passwords.items()}
    for name, secret in secrets_by_file.items():
        if replace or not (out / name).exists():
            _write_private(out / name, secret.encode())
    if replace or not (out / TOKEN_HASHES).exists():
        (out / TOKEN_HASHES).write_text(json.dumps({role: token_digest(token) for role, token in tokens.items()}, indent=2))


def ensure_credentials(out: Path, hosts: Iterable[str] = ()) -> Path:
    """The credentials at ``out``, made first when the folder holds none; a folder made
    before per-role files existed gets them, from its copies of all."""
    out = Path(out)
    if not (out / TOKENS).exists():
        return make_credentials(out, hosts)
    _write_per_role(out, load_tokens(out), redis_passwords(out), replace=False)
    _ensure_redis_cert(out)
    return out


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


def _one_per_role(folder: Path, name: str) -> dict[str, str]:
    """The JSON map ``name`` of ``folder``, with every role present and every value distinct."""
    values = _json_map(folder, name)
    missing = [r for r in ROLES if r not in values]
    if missing or len(set(values.values())) != len(values):
        raise CredentialsError(f"{folder / name}: needs a distinct value for each role of {list(ROLES)} (missing: {missing})")
    return values


def load_tokens(folder: Path) -> dict[str, str]:
    """role -> token, with every role present and every token distinct: the operator's
    copy (``tokens.json``), which no service needs."""
    return _one_per_role(Path(folder), TOKENS)


def is_digest(value: str) -> bool:
    """Whether ``value`` is a SHA-256 in lower-case hex."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def token_digests(folder: Path) -> dict[str, str]:
    """token digest -> role: what a server checks a caller's bearer token against, from
    ``token-hashes.json`` (in a folder made before that file existed: ``tokens.json``)."""
    folder = Path(folder)
    if (folder / TOKEN_HASHES).exists() or not (folder / TOKENS).exists():
        digests = _one_per_role(folder, TOKEN_HASHES)
        bad = [role for role, digest in digests.items() if not is_digest(digest)]
        if bad:
            raise CredentialsError(f"{folder / TOKEN_HASHES}: the entries of {bad} are not SHA-256 digests in hex")
    else:
        digests = {role: token_digest(token) for role, token in load_tokens(folder).items()}
    return {digest: role for role, digest in digests.items()}


def _single_secret(folder: Path, name: str, everyone: str, key: str) -> str:
    """The secret in the file ``name`` of ``folder``; where that file is missing, entry
    ``key`` of the JSON map ``everyone`` (the operator's copy, or a folder made before
    per-role files)."""
    path = folder / name
    if path.exists() or not (folder / everyone).exists():
        value = _read(folder, name).decode("utf-8", "replace").strip()
        if not value:
            raise CredentialsError(f"{path} is empty")
        return value
    values = _json_map(folder, everyone)
    if key not in values:
        raise CredentialsError(f"{folder / everyone} has no entry {key!r} (and there is no {name})")
    return values[key]


def role_token(folder: Path, role: str) -> str:
    """The bearer token of ``role``: ``<role>.token``, else its entry in ``tokens.json``."""
    if role not in ROLES:
        raise CredentialsError(f"unknown role {role!r}; roles are {list(ROLES)}")
    return _single_secret(Path(folder), token_file(role), TOKENS, role)


def redis_password(folder: Path, user: str) -> str:
    """The Redis ACL password of ``user`` (trainer, rollout or operator):
    ``redis-<user>.password``, else its entry in ``redis-users.json``."""
    if user not in REDIS_USERS:
        raise CredentialsError(f"unknown Redis user {user!r}; users are {list(REDIS_USERS)}")
    return _single_secret(Path(folder), redis_password_file(user), REDIS_PASSWORDS, user)


def redis_passwords(folder: Path) -> dict[str, str]:
    """Every Redis ACL user's password (the operator's copy)."""
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


def redis_tls(url: str) -> dict[str, str]:
    """TLS settings of a Redis client of a ``rediss://`` ``url``: trust the deployment's
    CA and present the client certificate, when the caller has an identity; none
    otherwise (a ``redis://`` URL, or a Redis of the user's own, trusted as the system
    trusts it)."""
    identity = identity_for(url) if urlsplit(url).scheme == "rediss" else None
    return {} if identity is None else redis_client_tls(identity.folder)


def redis_client_tls(folder: Path) -> dict[str, str]:
    """redis-py's TLS settings for a client of ``folder``'s deployment: its CA, and the
    client certificate to present."""
    cert, key = cert_path(Path(folder), "client")
    return {"ssl_ca_certs": str(Path(folder) / CA), "ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def main(argv: list[str]) -> int:
    """``meridian certs``: makes a credentials folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="meridian certs", description="Make a deployment's credentials: a private CA, server certificates, a client certificate, role tokens, API keys, Redis passwords and the version-signing key pair.")
    parser.add_argument("--out", type=Path, default=Path(".meridian/run/credentials"), help="folder to write (default: meridian up's, .meridian/run/credentials)")
    parser.add_argument("--host", action="append", default=[], help="another name or address the server certificates are valid for (repeatable; localhost and 127.0.0.1 always are)")
    parser.add_argument("--force", action="store_true", help="replace credentials already in --out (every token, key and certificate changes); without it an existing folder is kept and only the files an earlier release did not make are added")
    ns = parser.parse_args(argv)
    if (ns.out / TOKENS).exists() and not ns.force:
        # A folder of an earlier release: its secrets stay (deployed services hold them);
        # what it lacks is made for the names its certificates already hold.
        before = {p.name for p in ns.out.iterdir()}
        try:
            ensure_credentials(ns.out)
        except (CredentialsError, OSError, ValueError) as exc:
            parser.error(f"cannot complete {ns.out}: {exc}")
        added = sorted({p.name for p in ns.out.iterdir()} - before)
        print(f"credentials at {ns.out.resolve()} kept ({'added ' + ', '.join(added) if added else 'nothing missing'}; --force replaces them all)")
        return 0
    try:
        make_credentials(ns.out, ns.host, overwrite=ns.force)
    except CredentialsError as exc:
        parser.error(str(exc))
    print(f"credentials written to {ns.out.resolve()} (servers: --credentials {ns.out} or MERIDIAN_CREDENTIALS; clients also MERIDIAN_ROLE)")
    return 0
