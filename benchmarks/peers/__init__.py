"""Our tiers beside LMCache 0.5.6's, the same chunks through each: ``python -m benchmarks.peers``
(in ``.venv-peers``, where LMCache lives). ``common`` holds what both sides share and imports no
LMCache; ``lmcache`` drives LMCache's storage layer; ``sections`` and ``restart`` measure."""
