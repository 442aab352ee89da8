"""What the sidecar and its remote tier say to each other: the one package both ends import.

A change to how blocks travel lands here, once, and the server (``cachetier.server``) and the
client (``cachetier.tiers.remote``) pick it up; neither imports the other. Each module is named
for the transport it serves:

- ``http_batch``: the ``application/x-cachetier-batch`` body of the HTTP API (sans-IO framing).
- ``transfer_frames``: the hello, requests and replies of the binary transfer port (sans-IO).
- ``sockets``: the blocking sockets the transfer port (and the Redis tier's RESP path) run on.

The two framing modules do no I/O, so a test, a fuzzer or either end drives them with plain
bytes; only ``sockets`` touches the network. Nothing here imports an HTTP library, the server
or a tier.
"""
