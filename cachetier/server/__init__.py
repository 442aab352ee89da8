"""The cachetier sidecar: a FastAPI service serving a ``TieredStore`` to many engines over HTTP.

Kept import-light on purpose: ``cachetier.server.wire`` (the batch framing) is shared with the
aiohttp client in ``cachetier.tiers.remote``, which must not pull in FastAPI. Import the app
factory from ``cachetier.server.app``.
"""
