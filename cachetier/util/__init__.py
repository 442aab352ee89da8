"""Small helpers the other layers share, none of them about KV: config checks, retry back-off,
log throttling, secret redaction, TLS contexts, the file system of a path, recycled buffers,
the data-path threads, where a fetched payload lands, and one JSON request to a sidecar.

Imports nothing of cachetier but ``cachetier.errors``.
"""
