"""cachetier for LMCache: a storage plugin (``cachetier.connectors.lmcache.backend``, which imports
LMCache) and its chunk formats (``cachetier.connectors.lmcache.chunks``, which does not)."""
