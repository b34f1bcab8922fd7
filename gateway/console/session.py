"""Console sessions: a signed, expiring cookie bound to an admin token's id and scopes, and its CSRF token.

The cookie holds no secret of the admin token: a random session id, the token's id, its scopes and the
expiry, MAC'd with a key derived from the server pepper (so every replica sharing the database, which must
share the pepper to check API keys, accepts it). Each request re-reads the admin token's row, so revoking or
expiring the token ends its sessions at once; signing out records the session in the database
(``console_sign_outs``, until it would have expired), so every replica refuses its cookie from then on.
"""

from __future__ import annotations

import base64
import hmac
import secrets
import time
from dataclasses import dataclass

import orjson
from sqlalchemy import Connection, bindparam, delete, exists, select
from sqlalchemy.dialects import postgresql, sqlite

from audit.prepared import execute
from gateway.clock import as_utc, utcnow
from gateway.principal import Principal
from gateway.secrets import Hasher
from gateway.storage.models import AdminToken, ConsoleSignOut

COOKIE = "__Host-kvgate_console"  # __Host-: Secure, Path=/ and no Domain, enforced by the browser
LOGIN_COOKIE = "__Host-kvgate_console_login"  # binds the sign-in form's CSRF token before a session
SESSION_S = 30 * 60  # a session's longest life; never past its admin token's own expiry
_VERSION = 1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """A signed-in console user: the admin token it stands for, and when it ends (Unix seconds)."""

    sid: str
    token_id: str
    scopes: frozenset[str]
    expires_at: int

    @property
    def principal(self) -> Principal:
        """The admin principal the services see: the same one the token's API calls would have."""
        return Principal(kind="admin", key_id=self.token_id, scopes=self.scopes)

    def can(self, scope: str) -> bool:
        return scope in self.scopes


class SessionSigner:
    """Makes and checks session cookies and CSRF tokens with one key derived from the server pepper."""

    def __init__(self, hasher: Hasher) -> None:
        # A derived key: the pepper itself never signs anything else than key hashes.
        self._key = bytes.fromhex(hasher.hash("0" * 16, "kvgate-console-session-v1"))

    def _mac(self, purpose: str, data: str) -> str:
        return _b64(hmac.digest(self._key, f"{purpose}:{data}".encode(), "sha256"))

    def issue(self, principal: Principal) -> tuple[ConsoleSession, str]:
        """A new session for an admin principal and its cookie value."""
        expires_at = int(time.time()) + SESSION_S
        if principal.expires_at is not None:
            expires_at = min(expires_at, int(principal.expires_at.timestamp()))
        session = ConsoleSession(secrets.token_urlsafe(24), principal.key_id, principal.scopes, expires_at)
        body = {"v": _VERSION, "sid": session.sid, "tok": session.token_id,
                "sc": sorted(session.scopes), "exp": expires_at}
        payload = _b64(orjson.dumps(body))
        return session, f"{payload}.{self._mac('session', payload)}"

    def parse(self, cookie: str | None) -> ConsoleSession | None:
        """The session a cookie holds, if its MAC is right and it has not expired (``still_valid`` then
        checks it against the database)."""
        if not cookie or len(cookie) > 2048 or cookie.count(".") != 1:
            return None
        payload, mac = cookie.split(".")
        if not hmac.compare_digest(mac, self._mac("session", payload)):
            return None
        try:
            body = orjson.loads(_unb64(payload))
            session = ConsoleSession(str(body["sid"]), str(body["tok"]), frozenset(map(str, body["sc"])),
                                     int(body["exp"]))
        except (ValueError, KeyError, TypeError):
            return None
        if body.get("v") != _VERSION or session.expires_at <= time.time():
            return None
        return session

    def csrf(self, session: ConsoleSession) -> str:
        return self._mac("csrf", session.sid)

    def login_csrf(self, nonce: str) -> str:
        return self._mac("login", nonce)

    @staticmethod
    def is_same(expected: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(expected.encode(), given.encode())


_SIGN_OUTS = ConsoleSignOut.__table__
_IS_SIGNED_OUT = exists().where(_SIGN_OUTS.c.sid == bindparam("sid")).label("is_signed_out")
_TOKEN_ROW = select(AdminToken.revoked_at, AdminToken.expires_at, AdminToken.scopes, _IS_SIGNED_OUT).where(
    AdminToken.id == bindparam("token_id")
)
_EXPIRED = delete(_SIGN_OUTS).where(_SIGN_OUTS.c.expires_at <= bindparam("now"))


def still_valid(conn: Connection, session: ConsoleSession) -> ConsoleSession | None:
    """The session with the scopes its admin token still has, or ``None`` when it was signed out (on any
    replica) or its token is revoked, expired or gone (checked on every request, in one query)."""
    rows = execute(conn, _TOKEN_ROW, {"token_id": session.token_id, "sid": session.sid})
    if not rows:
        return None
    revoked_at, expires_at, scopes, is_signed_out = rows[0]
    expiry = as_utc(expires_at)
    if is_signed_out or revoked_at is not None or (expiry is not None and expiry <= utcnow()):
        return None
    current = session.scopes & frozenset((scopes or "").split())
    return session if current == session.scopes else ConsoleSession(
        session.sid, session.token_id, current, session.expires_at)


def sign_out(conn: Connection, session: ConsoleSession) -> None:
    """Refuse ``session`` from now on, on every replica sharing the database, until it would have expired.

    The table holds one row per session signed out and not yet expired: each sign-out deletes the rows
    of sessions that expired meanwhile (their cookies are refused by their expiry already).
    """
    conn.execute(_EXPIRED, {"now": int(time.time())})
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(_SIGN_OUTS).values(sid=session.sid, expires_at=session.expires_at)
                 .on_conflict_do_nothing())  # signed out twice (two tabs, two replicas): once is enough
