"""The settings of the sidecar's KV-event publisher, from the server's (checked; no I/O)."""

from __future__ import annotations

from cachetier.kvevents.config import PublisherConfig
from cachetier.kvindex import SHARED

_OUR_NAMES = {
    "curve_secret_key_file": "kv_events_curve_key",
    "curve_public_keys_dir": "kv_events_curve_clients",
}


def kv_events_publisher(
    kv_events: str | None,
    kv_events_replay: str | None = None,
    kv_events_curve_key: str | None = None,
    kv_events_curve_clients: str | None = None,
) -> PublisherConfig | None:
    """The sidecar's publisher (replica ``*``) of the ``ServerConfig`` settings of these names.

    Args:
        kv_events: the PUB endpoint, ``None`` for no events.
        kv_events_replay: the replay endpoint, ``None`` for none.
        kv_events_curve_key: the publisher's CURVE certificate with its secret key.
        kv_events_curve_clients: the folder of the readers' public certificates.

    Returns:
        The publisher's config, or ``None`` without ``kv_events``.

    Raises:
        ValueError: CURVE settings without ``kv_events``, one of the pair alone, or an
            endpoint beyond loopback without them.
    """
    keys = (kv_events_curve_key, kv_events_curve_clients)
    if kv_events is None:
        if keys != (None, None):
            raise ValueError("kv_events_curve_key and kv_events_curve_clients need kv_events")
        return None
    if (keys[0] is None) != (keys[1] is None):
        raise ValueError("kv_events_curve_key and kv_events_curve_clients go together")
    try:
        return PublisherConfig(
            SHARED,
            kv_events,
            replay_endpoint=kv_events_replay,
            curve_secret_key_file=kv_events_curve_key,
            curve_public_keys_dir=kv_events_curve_clients,
        )
    except ValueError as exc:
        # Its message names the publisher's settings: name the sidecar's.
        text = str(exc)
        for theirs, ours in _OUR_NAMES.items():
            text = text.replace(theirs, ours)
        raise ValueError(f"kv_events: {text}") from None
