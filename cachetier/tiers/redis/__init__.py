"""The Redis tier: block records in a single Redis or a Redis Cluster.

``tier`` is the tier, ``config`` its settings and the one redis-py client factory,
``transports`` the three ways it reaches Redis, ``resp`` a Redis protocol client for block
records, ``cluster`` the routing of commands to a cluster's masters, ``scripts`` the Lua of the
exact LRU, ``pins`` the pinned records kept next to it.
"""

from cachetier.tiers.redis.cluster import ClusterAddress, parse_cluster_url
from cachetier.tiers.redis.config import RedisTierConfig, make_client
from cachetier.tiers.redis.tier import AUTH_LOG_INTERVAL_S, RedisTier

__all__ = [
    "AUTH_LOG_INTERVAL_S",
    "ClusterAddress",
    "RedisTier",
    "RedisTierConfig",
    "make_client",
    "parse_cluster_url",
]
