"""The ``cachetier`` command: ``serve`` (the sidecar), ``report`` and the pin commands
(``main``), the pin commands' sidecar calls (``pins``) and the ports file a ``--port 0`` server
writes (``ports``).
"""
