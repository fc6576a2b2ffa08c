"""The benchmarks' files under ``--out``, each written atomically (``files.write_atomic``): text and
JSON. (What each benchmark writes is its own module's: ``lora_op``'s table and chart, ``engine``'s
results.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..files import write_atomic


def write_text(out: str | Path, name: str, text: str) -> Path:
    """Write ``text`` to ``out/name`` atomically (creating ``out``); returns the path."""
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, text.encode())


def write_json(out: str | Path, name: str, data: Any) -> Path:
    return write_text(out, name, json.dumps(data, indent=1))
