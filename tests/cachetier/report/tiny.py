"""A hand-made trace whose every hit is worked out by hand, shared by the report tests.

Blocks of 512 tokens. Replayed through a 3-block LRU 'cpu' tier over a 100-block 'disk' tier:

    request  ids        tokens  hit blocks (where)          hit tokens        lost
    0        1 2 3      1100    -                           0                 0
    1        1 2 3      1100    1 2 3 (cpu)                 cpu 1024          76 (block 3 is
                                                                              partial)
    2        1 2 4 5    1600    1 2 (cpu)                   cpu 1024          0
    3        6          512     -                           0                 0
    4        1 2        1024    1 2 (disk: cpu holds 4 5 6) disk 512          512 (block 2
                                                                              holds the last
                                                                              token)
    5        1 2 4 5    2048    1 2 (cpu) 4 5 (disk)        cpu 1024 disk 512 512 (block 5
                                                                              likewise)

A prompt that fills its last block cannot reuse that block: an engine computes at least the
prompt's last token to sample the first output token.
"""

from __future__ import annotations

import json
from pathlib import Path

REQUESTS = [
    (0, 1100, [1, 2, 3]),
    (1000, 1100, [1, 2, 3]),
    (2000, 1600, [1, 2, 4, 5]),
    (3000, 512, [6]),
    (4000, 1024, [1, 2]),
    (5000, 2048, [1, 2, 4, 5]),
]
CPU_BLOCKS, DISK_BLOCKS = 3, 100
HIT_TOKENS = [{}, {"cpu": 1024}, {"cpu": 1024}, {}, {"disk": 512}, {"cpu": 1024, "disk": 512}]
LOST_TOKENS = [0, 76, 0, 0, 512, 512]
HIT_BLOCKS = [0, 3, 2, 0, 2, 4]
NUM_TOKENS = sum(length for _, length, _ in REQUESTS)  # 7384
NUM_BLOCKS = sum(len(ids) for _, _, ids in REQUESTS)  # 17


def write_tiny_trace(path: Path) -> Path:
    """The trace as a Mooncake .jsonl file."""
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 9, "hash_ids": ids})
            + "\n"
            for t, n, ids in REQUESTS
        )
    )
    return path
