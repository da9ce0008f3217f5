"""How deeply a JSON text nests, measured without parsing it: a bound checked before anything
recursive (json.loads, pydantic, our validators, chat templates) sees the body.

Python's json and every recursive walk over a parsed body fail with RecursionError near 1,000 levels,
which would surface as a 500; no real request nests anywhere near MAX_JSON_DEPTH.
"""

from __future__ import annotations

import re

import numpy as np

MAX_JSON_DEPTH = 64
# A JSON string literal (escapes included); possessive, so a long string is one linear scan.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int32)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(text: bytes | str) -> int:
    """The deepest nesting of arrays and objects in a JSON text (0 for a scalar). Brackets inside
    strings do not count; an unterminated string counts its brackets (a conservative answer for
    text that is not valid JSON anyway)."""
    raw = text.encode("utf-8", errors="replace") if isinstance(text, str) else text
    if b"[" not in raw and b"{" not in raw:
        return 0
    stripped = _STRING.sub(b"", raw) if b'"' in raw else raw
    steps = _OPEN[np.frombuffer(stripped, dtype=np.uint8)]
    return int(np.cumsum(steps).max(initial=0))
