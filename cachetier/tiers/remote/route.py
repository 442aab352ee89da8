"""Where the remote tier moves blocks: the server's Unix socket, its transfer port, or HTTP.

The server names its transfer endpoints in ``/v1/limits`` (a ``TransferAddress``); this module
picks the one this tier may use and says which, for stats. No I/O but a check that a socket
path exists here.
"""

from __future__ import annotations

import os
import ssl

from cachetier.protocol.transfer_frames import TransferAddress
from cachetier.tiers.remote.config import RemoteTierConfig
from cachetier.tiers.remote.transfer import TransferClient, TransferPeer


def pick_transfer(
    config: RemoteTierConfig,
    tls: ssl.SSLContext | None,
    address: TransferAddress | None,
    old: TransferClient | None,
) -> TransferClient | None:
    """The transfer client for where the server takes transfers.

    Its Unix socket when that path exists here (same host), else its TCP port if that speaks
    TLS exactly when our url does (https: never the token in clear to a plaintext port).

    Args:
        config: the tier's settings (``transfer_host``, ``transfer_socket``, the token).
        tls: the tier's client context (``https://`` urls), else ``None``.
        address: where the server takes transfers, or ``None`` where it names none.
        old: the client in use; kept if it still goes to the same place and server, else
            closed.

    Returns:
        The client to use, or ``None`` for HTTP.
    """
    host = config.transfer_host
    where: tuple[str, int] | str | None = None
    port_tls: ssl.SSLContext | None = None
    if host is not None and address is not None:
        path = address.socket_path if config.transfer_socket else None
        if path is not None and os.path.exists(path):
            where = path
        elif address.port is not None and address.tls == config.tls:
            where, port_tls = (host, address.port), tls
    new = old
    if where is None or address is None:
        new = None
    elif old is None or (old.where, old.server_id, old.tls) != (
        where,
        address.server_id,
        port_tls is not None,
    ):
        peer = TransferPeer(  # a restarted server has a new id, maybe a new port
            where,
            address.server_id,
            token=config.token,
            tenant=config.tenant,
            connect_timeout_s=config.connect_timeout_s,
            timeout_s=config.timeout_s,
            tls=port_tls,
        )
        new = TransferClient(
            peer,
            max_connections=config.max_connections,
            max_record_bytes=config.max_record_bytes,
        )
    if old is not None and old is not new:
        old.close()
    return new


def transfer_label(transfer: TransferClient | None) -> str | None:
    """Where block transfers go, for stats.

    Args:
        transfer: the tier's transfer client, or ``None``.

    Returns:
        ``"unix:<path>"``, ``"tcp:<host>:<port>"``, ``"tls:<host>:<port>"``, or ``None`` for
        HTTP.
    """
    if transfer is None:
        return None
    if isinstance(transfer.where, str):
        return f"unix:{transfer.where}"
    return "{}:{}:{}".format("tls" if transfer.tls else "tcp", *transfer.where)
