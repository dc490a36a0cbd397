"""Artifact keys: one per run and kind, so the Artifacts page keeps each run's history across
the flow runs that trained it."""

from __future__ import annotations

import hashlib
import re


def artifact_key(name: str, what: str) -> str:
    """A key Prefect accepts (lowercase letters, digits, dashes) that names run `name`: its
    name made to fit, and a hash of it, so that runs whose names differ in case or punctuation
    keep apart."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60] or "run"
    return f"ft-train-{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}-{what}"
