"""CURVE authentication and encryption for routing-replay's tcp sockets: key files, socket options, allow-lists.

Key files are pyzmq's certificate format (`zmq.auth.create_certificates`): NAME.key holds the public key,
NAME.key_secret the public and the secret key. A server socket (broker frontend and backend, consumer --serve)
takes its own secret cert and accepts only clients whose public cert is in an allow-list directory, checked by a
ZAP handler (pyzmq's ThreadAuthenticator, one per process context). A client socket (producer, consumer towards
the broker, trainer) takes its own secret cert and pins the server's public cert. docs/THREAT_MODEL.md says what
this protects and what it does not.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path

import zmq
import zmq.utils.z85

log = logging.getLogger("routing_replay.protocol.security")

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def create_keys(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key (public) and DIR/NAME.key_secret (secret, mode 0600). Refuses to overwrite."""
    import zmq.auth
    d = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name")
    pub, sec = d / f"{name}.key", d / f"{name}.key_secret"
    for p in (pub, sec):
        if p.exists():
            raise FileExistsError(f"{p} exists; delete it first to rotate the key")
    d.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        public_file, secret_file = zmq.auth.create_certificates(str(d), name)
    finally:
        os.umask(old)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


def load_secret(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a NAME.key_secret file; ValueError if the file has no secret key."""
    import zmq.auth
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read CURVE secret cert {path}: {e}") from None
    if not secret:
        raise ValueError(f"{path} holds no secret key (pass NAME.key_secret, not NAME.key)")
    return public, secret


def load_public(path: str | os.PathLike) -> bytes:
    import zmq.auth
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read CURVE public cert {path}: {e}") from None
    return public


def curve_server(sock: zmq.Socket, secret_file: str | os.PathLike) -> None:
    """Make `sock` a CURVE server with its own cert (call before bind)."""
    public, secret = load_secret(secret_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def curve_client(sock: zmq.Socket, secret_file: str | os.PathLike, server_key_file: str | os.PathLike) -> None:
    """Make `sock` a CURVE client with its own cert, pinned to the server's public cert (call before connect)."""
    public, secret = load_secret(secret_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = load_public(server_key_file)


MAX_REFUSED_PEERS = 4096       # peers whose refusal was logged (beyond: counted only)


def _refusal_counting(base):
    """pyzmq's ThreadAuthenticator that counts every refused handshake (`refused`) and logs each refused peer (its
    address and CURVE public key) once at WARNING, with the count so far: a client with a key not on the allow-list
    is otherwise refused at DEBUG only and just times out. Read on the ZAP thread; `refused` is a plain counter."""

    class RefusalCountingAuthenticator(base):
        refused = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._peer = ("?", "?")
            self._warned: set = set()

        async def handle_zap_message(self, msg):
            address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
            key = zmq.utils.z85.encode(msg[6]).decode() if len(msg) > 6 and len(msg[6]) == 32 else "?"
            self._peer = (address, key)
            await super().handle_zap_message(msg)

        def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
            if status_code != b"200":
                self.refused += 1
                if self._peer not in self._warned and len(self._warned) < MAX_REFUSED_PEERS:
                    self._warned.add(self._peer)
                    log.warning("curve handshake refused: peer address=%s public_key=%s (%s; not in the allow-list "
                                "%s?) curve_refused=%d", self._peer[0], self._peer[1],
                                status_text.decode("utf-8", "replace"), self.allow_dir, self.refused)
            super()._send_zap_reply(request_id, status_code, status_text, user_id)

    return RefusalCountingAuthenticator


class HandshakeWatch:
    """Own a socket monitor on a CURVE server socket: count the handshakes that fail before the allow-list is asked
    (a client pinned to another server key, a client without CURVE), and say so once at WARNING. libzmq's monitor
    names the bound endpoint, not the peer, so this is once per endpoint; refusals by the allow-list are logged per
    peer by the authenticator. Created, read (`drain`, when `mon` polls readable) and closed by the socket's thread."""

    def __init__(self, sock: zmq.Socket, what: str):
        self.sock, self.what = sock, what
        self.mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self.failed = 0

    def drain(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while True:
            try:
                ev = recv_monitor_message(self.mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.warning("curve handshake failed on %s %s (%s %s: a client pinned to another server key, or one "
                            "without CURVE) handshake_failed=%d", self.what,
                            ev["endpoint"].decode("utf-8", "replace"), zmq.Event(ev["event"]).name,
                            ev["value"], self.failed)

    def close(self) -> None:
        self.mon.close(0)
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass


def start_authenticator(ctx: zmq.Context, allow_dir: str | os.PathLike):
    """Start a ZAP handler on `ctx` that accepts CURVE clients whose NAME.key is in `allow_dir`.

    The directory is read once, here; restart the process to change the allow-list. Returns the authenticator
    (call .stop() when the sockets are closed); its `refused` counts refused handshakes, each refused peer is
    logged once at WARNING. (A client pinned to another server key fails before the allow-list is consulted: the
    client reports that one, TrainerClient and the producer as a refused handshake.)
    """
    from zmq.auth.thread import ThreadAuthenticator
    d = Path(allow_dir)
    if not d.is_dir():
        raise ValueError(f"CURVE allow-list {d} is not a directory")
    n = len(list(d.glob("*.key")))
    if n == 0:
        raise ValueError(f"CURVE allow-list {d} holds no NAME.key public certs")
    auth = _refusal_counting(ThreadAuthenticator)(ctx, log=logging.getLogger("routing_replay.protocol.security.zap"))
    auth.allow_dir = d
    auth.start()
    auth.configure_curve(domain="*", location=str(d))
    log.info("curve allow_dir=%s keys=%d", d, n)
    return auth


def is_loopback_or_local(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address; False for any other tcp address or wildcard."""
    if "://" not in endpoint:
        return False
    transport, addr = endpoint.split("://", 1)
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    if ";" in addr:                       # tcp://source;dest: what is bound/connected is the last part
        addr = addr.rsplit(";", 1)[1]
    host = addr.rsplit(":", 1)[0] if ":" in addr else addr
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False                      # an interface name, a host name, or "*"


CLI_REMEDY = ("pass --curve-secret/--curve-allow (keys from `routing-replay keys`), or --insecure to accept "
              "that")


def check_bind(endpoint: str, *, curve: bool, insecure: bool, what: str, remedy: str = CLI_REMEDY) -> None:
    """Refuse to bind a non-loopback tcp endpoint in the clear unless the operator said --insecure (or what
    `remedy` names: the way out where the caller is not the CLI)."""
    if curve or insecure or is_loopback_or_local(endpoint):
        return
    raise ValueError(f"{what} {endpoint} is reachable from other hosts and would run without authentication or "
                     f"encryption: {remedy}")
