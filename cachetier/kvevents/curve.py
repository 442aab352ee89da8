"""CURVE authentication of the KV-event sockets: keys read from files, clients allowed by key.

A publisher's PUB and replay sockets are CURVE servers: a ZAP handler (pyzmq's
``ThreadAuthenticator``) lets a client finish its handshake only when its public key is one of
the certificates in the allowed folder, so a reader without a listed key receives nothing (ZMQ
drops the connection before any message). The files are what ``zmq.auth.create_certificates``
writes (``<name>.key`` public, ``<name>.key_secret`` both halves); a Kubernetes Secret mounts
them as files.
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def _load(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"CURVE key file {path!r} does not exist")
    try:
        public, secret_key = zmq.auth.load_certificate(file)
    except (ValueError, OSError) as exc:
        raise ValueError(f"CURVE key file {path!r} is not a ZMQ certificate: {exc}") from exc
    if secret and secret_key is None:
        raise ValueError(f"CURVE key file {path!r} holds no secret key (give the .key_secret)")
    return public, secret_key


def start_authenticator(ctx: zmq.Context, public_keys_dir: str) -> ThreadAuthenticator:
    """Start a ZAP handler on ``ctx`` that allows CURVE clients of ``public_keys_dir`` only.

    Args:
        ctx: the context whose server sockets it authenticates (start it before binding).
        public_keys_dir: the folder of allowed public certificates (``*.key``).

    Returns:
        The running authenticator; ``stop()`` it before terminating ``ctx``.

    Raises:
        ValueError: the folder does not exist or lists no certificate.
    """
    folder = Path(public_keys_dir)
    if not folder.is_dir() or not any(folder.glob("*.key")):
        raise ValueError(f"CURVE public keys folder {public_keys_dir!r} holds no *.key file")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(folder))
    return auth


def make_server(sock: zmq.Socket, secret_key_file: str) -> None:
    """Make ``sock`` a CURVE server with the certificate in ``secret_key_file`` (before bind).

    Raises:
        ValueError: the file is missing or holds no secret key.
    """
    public, secret = _load(secret_key_file, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_client(sock: zmq.Socket, secret_key_file: str, server_key_file: str) -> None:
    """Make ``sock`` a CURVE client of the server whose public certificate is
    ``server_key_file``, as the certificate in ``secret_key_file`` (before connect).

    Raises:
        ValueError: a file is missing, or the first holds no secret key.
    """
    public, secret = _load(secret_key_file, secret=True)
    server_public, _ = _load(server_key_file, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
