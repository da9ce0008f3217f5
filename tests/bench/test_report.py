"""bench.report's JSON writer: compact, round-trips to 6 significant digits, gzipped for .gz paths."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from bench.report import compact_json, write_json

RESULT = {
    "environment": {"cpu": "x", "load": 1.95},
    "results": [{"per_step": [0.318418499318, 12.000001, 3], "counts": {"by_site": {"a.py:1": 4}}, "none": None}],
    "empty": {"list": [], "dict": {}},
    "nan": math.nan,
}


def test_compact_json_round_trips_to_six_significant_digits() -> None:
    text = compact_json(RESULT)
    back = json.loads(text)
    assert back["results"][0]["per_step"] == [0.318418, 12.0, 3]  # ints stay ints
    assert back["results"][0]["counts"] == RESULT["results"][0]["counts"] and back["empty"] == RESULT["empty"]
    assert back["environment"] == RESULT["environment"] and back["results"][0]["none"] is None
    assert '"per_step": [0.318418, 12.0, 3]' in text  # samples on one line, objects one key per line
    assert '\n  "environment": {\n    "cpu": "x",' in text


def test_write_json_gzips_a_gz_path_reproducibly(tmp_path: Path) -> None:
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    result = {k: v for k, v in RESULT.items() if k != "nan"}
    write_json(result, plain)
    write_json(result, packed)
    first = packed.read_bytes()
    assert gzip.decompress(first).decode() == plain.read_text()
    write_json(result, packed)
    assert packed.read_bytes() == first  # no timestamp in the header: same result, same bytes
