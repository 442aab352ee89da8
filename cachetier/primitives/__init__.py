"""What every layer names blocks by, and nothing else: the chained block key and its namespace
(``keys``), the dtype and layout names of a KV record (``kv_format``), and the model fingerprint
that keeps one model's records from another's (``fingerprint``).

Imports only ``cachetier.util`` and ``cachetier.errors``: everything else builds on these.
"""
