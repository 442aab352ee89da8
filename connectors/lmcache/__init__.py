"""cachetier for LMCache: a storage plugin (``connectors.lmcache.backend``, which imports
LMCache) and its chunk formats (``connectors.lmcache.chunks``, which does not)."""
