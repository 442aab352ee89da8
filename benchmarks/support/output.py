"""What a benchmark prints: a summary for people, then (``--json``) one JSON line, last."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a human summary, then (with ``--json``) the result as the last line."""
    for key, value in result.items():
        if isinstance(value, float):
            print(f"{key:>32}: {value:.4g}", file=sys.stderr if as_json else sys.stdout)
        elif not isinstance(value, dict):
            print(f"{key:>32}: {value}", file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result, sort_keys=True))
