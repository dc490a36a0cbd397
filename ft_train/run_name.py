"""Run names a driver makes: rendered from a template, or generated where none is given.

Templates: `run_config.name` may hold `{scheduled_start}` or `{scheduled_start:FORMAT}` fields
(strftime codes), rendered once, by the driver, from the start time its flow run was scheduled
for. Each slot of a schedule is then a run of its own (`nightly-{scheduled_start:%Y%m%d-%H%M}` ->
`nightly-20261203-0300`), where one fixed name would have every night resume, and find finished,
the first night's run.

Generated names: a `RunConfig` without a name (Ray's default: `ray_train_run-%Y-%m-%d_%H-%M-%S`)
is named after its flow run, `ft_train_run-%Y-%m-%d_%H-%M-%S-<8 hex digits of the flow run's
id>`, from the time the flow run was created: each flow run its own run (two started in the same
second too), and the same name wherever the driver asks (the flow run's name, the run's
directory), since both facts are the flow run's and never change.

A rerun of a crashed driver keeps the rendered or generated name (its parameters carry the
crashed flow run's name, see `deployments/automations.py`): it must resume that run, not start
one named after its own start or its own id.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from uuid import UUID

FIELD = re.compile(r"\{scheduled_start(?::([^{}]*))?\}")
DEFAULT_FORMAT = "%Y%m%d-%H%M%S"
# What a template is checked with, before any run: a time whose every field has two digits or more.
SAMPLE = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)

GENERATED_PREFIX = "ft_train_run"
GENERATED_FORMAT = "%Y-%m-%d_%H-%M-%S"  # Ray's
GENERATED = re.compile(rf"{GENERATED_PREFIX}-\d{{4}}(-\d\d){{2}}_\d\d(-\d\d){{2}}-[0-9a-f]{{8}}")


def is_template(name: str | None) -> bool:
    return name is not None and FIELD.search(name) is not None


def render(name: str, scheduled_start: datetime) -> str:
    """`name` with each `{scheduled_start:FORMAT}` field replaced by `scheduled_start` in UTC,
    formatted (`%Y%m%d-%H%M%S` when no FORMAT is given); a name without fields unchanged."""
    when = scheduled_start.astimezone(UTC)
    return FIELD.sub(lambda m: when.strftime(m.group(1) or DEFAULT_FORMAT), name)


def generate(flow_run_id: UUID | str, created: datetime) -> str:
    """The name of a run given none, from its flow run: `ft_train_run-<created, UTC>-<id>`.
    The id's last 8 hex digits: random in a UUID4, and in a UUID7 too (its first ones are a
    clock's, the same for runs created close together)."""
    when = created.astimezone(UTC) if created.tzinfo else created
    return f"{GENERATED_PREFIX}-{when.strftime(GENERATED_FORMAT)}-{UUID(str(flow_run_id)).hex[-8:]}"
