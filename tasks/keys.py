"""Artifact keys: one per run and kind, so the Artifacts page keeps each run's history across
the flow runs that trained it."""

from __future__ import annotations

import hashlib
import re

# What Prefect accepts in a key is lowercase letters, digits and dashes; a name that is already
# such a word (no leading, trailing or doubled dash) is its own slug and needs no hash.
_PLAIN = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
MAX_PLAIN = 80  # longer names are cut, and then a hash keeps them apart


def artifact_key(name: str, what: str) -> str:
    """`{name}-{what}`, a key Prefect accepts, for run `name`'s artifact `what` (a fixed word:
    progress, metrics, metrics-plot, ...).

    A name such as `demo` or `nightly-2026-12-07` is used as it is, so that the Artifacts page
    lists `demo-progress`. Any other name is made to fit (lowercase, runs of other characters to
    one dash, cut to 60) and followed by a hash of the name, only then: `Run.A` and `run-a` would
    otherwise share their artifacts. The kinds are fixed and none is the end of another after a
    dash, so two runs never share a key."""
    if _PLAIN.fullmatch(name) and len(name) <= MAX_PLAIN:
        return f"{name}-{what}"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60].strip("-") or "run"
    return f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}-{what}"
