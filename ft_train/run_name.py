"""Run-name templates: `run_config.name` may hold `{scheduled_start}` or
`{scheduled_start:FORMAT}` fields (strftime codes), rendered once, by the driver, from the start
time its flow run was scheduled for. Each slot of a schedule is then a run of its own
(`nightly-{scheduled_start:%Y%m%d-%H%M}` -> `nightly-20261203-0300`), where one fixed name would
have every night resume, and find finished, the first night's run.

A rerun of a crashed driver keeps the rendered name (its parameters carry it, see
`deployments/automations.py`): it must resume that run, not start one named after its own start.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

FIELD = re.compile(r"\{scheduled_start(?::([^{}]*))?\}")
DEFAULT_FORMAT = "%Y%m%d-%H%M%S"
# What a template is checked with, before any run: a time whose every field has two digits or more.
SAMPLE = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)


def is_template(name: str) -> bool:
    return FIELD.search(name) is not None


def render(name: str, scheduled_start: datetime) -> str:
    """`name` with each `{scheduled_start:FORMAT}` field replaced by `scheduled_start` in UTC,
    formatted (`%Y%m%d-%H%M%S` when no FORMAT is given); a name without fields unchanged."""
    when = scheduled_start.astimezone(UTC)
    return FIELD.sub(lambda m: when.strftime(m.group(1) or DEFAULT_FORMAT), name)
