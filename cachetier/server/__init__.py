"""The cachetier sidecar: a FastAPI service serving a ``TieredStore`` to many engines over HTTP.

What it shares with its client, the remote tier, is the wire formats in ``cachetier.protocol``;
neither imports the other. Import the app factory from ``cachetier.server.app``.
"""
