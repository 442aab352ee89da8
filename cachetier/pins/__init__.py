"""Pins: keys an eviction never takes.

``pinset`` is one tier's pinned keys and their bound in bytes (the tiers use it), ``registry``
the file that keeps a store's pins across restarts, and ``store`` a pin applied to every tier
of a store, all or nothing. The Redis tier keeps its pins in Redis itself
(``cachetier.tiers.redis.pins``), the HTTP routes live with the servers that serve them, and
``cachetier pin`` with the command line.
"""
