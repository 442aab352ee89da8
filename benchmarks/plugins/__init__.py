"""cachetier behind the plugin points of SGLang and LMCache: ``python -m benchmarks.plugins``.
``sglang`` runs in this environment, ``lmcache`` in ``.venv-peers`` as a child process."""
