"""TLS contexts: the one place cachetier builds an ``ssl.SSLContext``.

The sidecar's HTTP server and its transfer port share ``server_context``; the remote tier
(HTTP and transfer port) and the Redis tier's bulk path use ``client_context``. Clients verify
the peer's chain and host name unless told not to.
"""

from __future__ import annotations

import ssl

# TLS 1.2 is the oldest version without known breaks that every client we talk to speaks.
MIN_VERSION = ssl.TLSVersion.TLSv1_2


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server-side context serving ``cert_file`` (the chain, leaf first) with ``key_file``.

    Args:
        cert_file: PEM certificate chain.
        key_file: PEM private key of the leaf certificate.

    Returns:
        The context.

    Raises:
        ValueError: a file cannot be read, or the key does not match the certificate.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MIN_VERSION
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"cannot load the TLS certificate {cert_file!r} with key {key_file!r}: {exc}"
        ) from None
    return context


def client_context(
    ca_file: str | None = None,
    verify: bool = True,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> ssl.SSLContext:
    """A client-side context.

    Args:
        ca_file: PEM bundle of the CAs to trust; ``None`` trusts the system's.
        verify: check the server's chain and that its certificate names the host connected
            to. ``False`` still encrypts but lets anyone on the path impersonate the server:
            for tests against a throwaway certificate only.
        cert_file: PEM client certificate, for servers that ask for one (mutual TLS).
        key_file: PEM private key of ``cert_file`` (``None``: it is in ``cert_file``).

    Returns:
        The context.

    Raises:
        ValueError: a file cannot be read or holds no usable certificate.
    """
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA bundle {ca_file!r}: {exc}") from None
    context.minimum_version = MIN_VERSION
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the client certificate {cert_file!r}: {exc}") from None
    return context
