"""The repository root and a CLI runner in a real subprocess, as a user runs ``cyclone-kit``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m cyclone_kit ARGS`` as a user would; returns the completed process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "cyclone_kit", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


def run_dir_of(stdout: str) -> Path:
    """The ``run dir: PATH`` that ``run``/``submit`` print first."""
    import re

    match = re.search(r"^run dir: (.+)$", stdout, re.MULTILINE)
    assert match, stdout
    return Path(match.group(1))


def jsonl_records(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (blank lines skipped)."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
