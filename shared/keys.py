"""CurveZMQ keys: make them (``weir keys DIR``), load them, secure sockets with them.

A keys directory holds three key pairs as ZeroMQ certificate files (``NAME.key`` is the
public half, ``NAME.key_secret`` both halves, mode 0600):

* ``cluster``: the cluster key. The scheduler's executor socket is a CURVE server with it,
  every executor connects as a CURVE client with it, and the socket's ZAP handler lets in
  only its public key: an executor must hold the cluster secret to reach the handshake.
* ``server``: the scheduler's client socket is a CURVE server with it; clients pin
  ``server.key`` (they hold no scheduler secret).
* ``client``: the client key; the client socket lets in only ``client.key``.

Each process needs only its own files (``FILES_NEEDED``). Without a keys directory every
socket is plain ZeroMQ, as before (bound to loopback by default).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

_log = logging.getLogger(__name__)

KEYS_DIR_ENV = "WEIR_KEYS_DIR"
CLUSTER, SERVER, CLIENT = "cluster", "server", "client"
# ZAP domains: one allow-list per scheduler socket.
CLIENT_DOMAIN = "weir.clients"
EXECUTOR_DOMAIN = "weir.executors"
FILES_NEEDED = {
    "scheduler": (f"{CLUSTER}.key_secret", f"{SERVER}.key_secret", f"{CLIENT}.key"),
    "executor": (f"{CLUSTER}.key_secret",),
    "client": (f"{CLIENT}.key_secret", f"{SERVER}.key"),
}
_REFUSAL_LOG_INTERVAL_S = 60.0
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a client (SDK, gateway, ``weir generate``) needs: its key and the server's."""

    own: KeyPair
    server_public: bytes

    @classmethod
    def load(cls, directory: Path) -> ClientKeys:
        return cls(load_pair(directory, CLIENT), load_public(directory, SERVER))


@dataclass(frozen=True, slots=True)
class SchedulerKeys:
    cluster: KeyPair
    server: KeyPair
    client_public: bytes

    @classmethod
    def load(cls, directory: Path) -> SchedulerKeys:
        return cls(
            load_pair(directory, CLUSTER),
            load_pair(directory, SERVER),
            load_public(directory, CLIENT),
        )


def keys_dir(value: str | os.PathLike[str] | None) -> Path | None:
    """The keys directory in effect: ``value``, else ``$WEIR_KEYS_DIR``, else None (no CURVE)."""
    chosen = value or os.environ.get(KEYS_DIR_ENV) or None
    return None if chosen is None else Path(chosen)


def make_keys(directory: Path) -> list[Path]:
    """Write a fresh set of key pairs into ``directory`` (created 0700); returns the files.

    Refuses to replace existing keys: every process holding them would be locked out.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    names = [f"{name}.{ext}" for name in (CLUSTER, SERVER, CLIENT) for ext in ("key", "key_secret")]
    existing = [n for n in names if (directory / n).exists()]
    if existing:
        raise FileExistsError(
            f"{directory} already holds {', '.join(existing)}; remove them or choose another "
            "directory (replacing keys locks out every process that holds the old ones)"
        )
    # Written into a private (0700) folder and moved into place, so a secret file is
    # never readable by others, not even between its creation and its chmod.
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=".weir-keys-"))
    try:
        for name in (CLUSTER, SERVER, CLIENT):
            public, secret = zmq.auth.create_certificates(staging, name)
            os.chmod(public, 0o644)
            os.chmod(secret, 0o600)
        for n in names:
            os.replace(staging / n, directory / n)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [directory / n for n in names]


def load_pair(directory: Path, name: str) -> KeyPair:
    public, secret = _load(directory / f"{name}.key_secret")
    if secret is None:
        raise ValueError(f"{directory / (name + '.key_secret')} holds no secret key")
    return KeyPair(public, secret)


def load_public(directory: Path, name: str) -> bytes:
    return _load(directory / f"{name}.key")[0]


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not zmq.has("curve"):
        raise ValueError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE: keys cannot be used"
        )
    if not path.is_file():
        raise ValueError(
            f"keys directory {path.parent} has no {path.name} (make keys with `weir keys DIR`)"
        )
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a ZeroMQ certificate: {exc}") from None
    return public, secret


def serve_curve(sock: zmq.Socket[Any], key: KeyPair, domain: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server whose peers the ZAP ``domain`` admits."""
    sock.curve_server = True
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret
    sock.zap_domain = domain.encode()


def connect_curve(sock: zmq.Socket[Any], own: KeyPair, server_public: bytes) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the server holding ``server_public``."""
    sock.curve_publickey = own.public
    sock.curve_secretkey = own.secret
    sock.curve_serverkey = server_public


class HandshakeMonitor:
    """Why ``sock`` cannot connect to ``address``, from its handshake events (made before
    ``sock`` connects; ``close`` it before the socket).

    A security mismatch or a refused key makes libzmq drop the connection for good
    (``reason`` says which). A server that cannot decrypt our handshake (we pin the wrong
    server key) closes the connection without a word and libzmq retries forever:
    ``dropped`` counts such handshakes in a row (so does anything in between that closes
    connections, so it is a hint, not a verdict). Await ``socket`` for events and pass
    them to ``reason``, or call ``pending``. A connection that had shaken hands and then
    closes (the peer exited or restarted; libzmq reconnects by itself) calls ``on_lost``,
    and ``connection_lost`` holds until a handshake succeeds again.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        address: str,
        who: str,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.socket = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        # A blocking-API handle on it, to read events without awaiting.
        self._now: zmq.Socket[bytes] = zmq.Socket.shadow(self.socket.underlying)
        self._sock, self._address, self._who = sock, address, who
        self._on_lost = on_lost
        self.dropped = 0
        self.connected = False
        self.connection_lost = False

    def reason(self, frames: list[bytes]) -> str | None:
        """The refusal one event (its frames) amounts to, else None."""
        event = parse_monitor_message(frames)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.dropped = 0
            self.connected, self.connection_lost = True, False
            return None
        if kind == zmq.EVENT_DISCONNECTED:
            if self.connected:
                self.connected, self.connection_lost = False, True
                if self._on_lost is not None:
                    self._on_lost()
            return None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.dropped += 1
            return None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"{self._address} refused this {self._who}'s CurveZMQ key (ZAP status {value}): "
                "give it the keys the server's were made with (--keys-dir / $WEIR_KEYS_DIR)"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (
                f"{self._address} and this {self._who} disagree on encryption: one side has "
                "CurveZMQ keys (--keys-dir / $WEIR_KEYS_DIR) and the other has none"
            )
        return (
            f"the CurveZMQ handshake with {self._address} failed (ZMTP protocol error "
            f"{value:#x}): check both sides' keys"
        )

    def pending(self) -> str | None:
        """The refusal among the events already in, else None (does not wait)."""
        while True:
            try:
                frames = self._now.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            refusal = self.reason(frames)
            if refusal is not None:
                return refusal

    def close(self) -> None:
        self._sock.disable_monitor()
        self.socket.close(linger=0)


class _AllowList:
    """A ZAP credentials provider: admits these public keys, logs refusals (rate-limited: a
    refused peer reconnects every few hundred milliseconds)."""

    def __init__(self, what: str, keys: set[bytes]) -> None:
        self._what = what
        self._keys = keys
        self._refused = 0
        self._last_log = -_REFUSAL_LOG_INTERVAL_S

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._last_log >= _REFUSAL_LOG_INTERVAL_S:
            _log.warning(
                "refused %d %s connection(s) with an unknown CURVE key (latest %s)",
                self._refused,
                self._what,
                key.decode(errors="replace"),
            )
            self._refused, self._last_log = 0, now
        return False


def start_authenticator(ctx: zmq.asyncio.Context, keys: SchedulerKeys) -> AsyncioAuthenticator:
    """The scheduler's ZAP handler (on the running loop): its client socket admits the client
    key only, its executor socket the cluster key only."""
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(CLIENT_DOMAIN, _AllowList("client", {keys.client_public}))
    auth.configure_curve_callback(EXECUTOR_DOMAIN, _AllowList("executor", {keys.cluster.public}))
    return auth
