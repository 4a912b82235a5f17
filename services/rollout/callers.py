"""Traffic classes by caller: whether a request is production (never waits for RL, and
preempts it) or RL (admitted into spare capacity) is decided here, from the caller's
API key, never from a field the caller sets. Both front doors (gRPC ``Generate`` and the
OpenAI-compatible API) read the key from ``Authorization: Bearer <key>``.

The key file is a JSON object, key -> class::

    {"prod-frontend-key": "production", "eval-batch-key": "rl"}

A key may also be given as its SHA-256 in hex, ``"sha256:<hex>"`` (as the credentials'
``api-keys.json`` gives them): the server keeps only digests either way, and a key file
of digests holds no usable key.

Callers without a key get ``anonymous`` (production, rl, or deny). With no key file
every caller is anonymous, whatever it sends (the ``openai`` client always sends some
key); with one, an unknown key is refused. A rollout serving with credentials (the
default) has no anonymous callers: its keys are the credentials' ``api-keys.json`` plus
the key file's, and each key is also a token its gRPC interceptor admits (role
``production``)."""
from __future__ import annotations

import json
from pathlib import Path

from meridian.access import token_digest
from meridian.credentials import API_KEYS, DIGEST_PREFIX, is_digest
from meridian.errors import Unauthenticated
from services.rollout.engine import PRIORITY_PRODUCTION, PRIORITY_RL

CLASSES = {"production": PRIORITY_PRODUCTION, "rl": PRIORITY_RL}


class CallerClasses:
    """The configured class of each API key."""

    def __init__(self, keys: dict[str, str], anonymous: str = "production") -> None:
        bad = {k: c for k, c in keys.items() if c not in CLASSES or not k or k.startswith(DIGEST_PREFIX) and not is_digest(k.removeprefix(DIGEST_PREFIX))}
        if bad:
            raise ValueError(f"caller classes must map non-empty keys (or {DIGEST_PREFIX}<SHA-256 in hex>) to one of {sorted(CLASSES)}; bad entries for {len(bad)} key(s)")
        if anonymous not in (*CLASSES, "deny"):
            raise ValueError(f"anonymous class must be one of {sorted(CLASSES)} or deny, got {anonymous!r}")
        # Looked up by digest: a key never stays in memory, and lookups do not time the key.
        self._digests = {_digest_of(k): c for k, c in keys.items()}
        self.anonymous = anonymous

    @classmethod
    def load(cls, path: str, anonymous: str) -> CallerClasses:
        """From a JSON key file ('' : no keys, everyone anonymous)."""
        if not path:
            return cls({}, anonymous)
        try:
            keys = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"caller classes file {path}: {exc}") from None
        if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise ValueError(f"caller classes file {path} must be a JSON object of key -> class strings")
        return cls(keys, anonymous)

    @classmethod
    def authenticated(cls, credentials_dir: Path, path: str) -> CallerClasses:
        """An authenticated deployment's: the credentials' API keys (the production and
        operator tokens) and those of the key file at ``path`` (if any); no anonymous
        caller."""
        callers = cls.load(str(Path(credentials_dir) / API_KEYS), "deny")
        if path:
            callers._digests.update(cls.load(path, "deny")._digests)
        return callers

    def digests(self) -> list[str]:
        """The known API keys' digests (each key is a caller the server's interceptor
        admits, see :func:`meridian.access.token_digest`)."""
        return list(self._digests)

    def classify(self, authorization: str | None) -> int:
        """The engine priority of a caller from its ``Authorization`` value; raises
        :class:`Unauthenticated` for an unknown key, a malformed header, or an anonymous
        caller when anonymous callers are denied."""
        if not authorization or not self._digests:
            if self.anonymous == "deny":
                raise Unauthenticated("this server needs an API key (Authorization: Bearer <key>)")
            return CLASSES[self.anonymous]
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the Authorization value must be 'Bearer <key>'")
        traffic = self._digests.get(token_digest(key.strip()))
        if traffic is None:
            raise Unauthenticated("unknown API key")  # the key itself is not echoed
        return CLASSES[traffic]


def _digest_of(key: str) -> str:
    """A key file entry's digest: given (``sha256:<hex>``), or of the key itself."""
    return key.removeprefix(DIGEST_PREFIX) if key.startswith(DIGEST_PREFIX) else token_digest(key)
