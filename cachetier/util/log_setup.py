"""cachetier's log lines inside another engine: the same handlers, so the same format.

vLLM and LMCache configure their own loggers (``vllm``, ``lmcache``) and leave the root logger
bare, so a ``cachetier.*`` warning reached Python's last-resort handler and printed as a bare
line with no level or time. A plugin calls ``share_handlers`` as it starts.
"""

from __future__ import annotations

import logging


def share_handlers(engine_logger: str) -> None:
    """Give the ``cachetier`` logger the handlers of ``engine_logger`` where neither it nor the
    root logger has any (a host that configured logging itself is left as it is), at INFO.

    Args:
        engine_logger: the engine's own logger (``"vllm"``, ``"lmcache"``, ``"sglang"``).
    """
    ours = logging.getLogger("cachetier")
    if ours.handlers or logging.getLogger().handlers:
        return
    theirs = logging.getLogger(engine_logger).handlers
    for handler in theirs:
        ours.addHandler(handler)
    if theirs and ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
