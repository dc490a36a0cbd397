"""Whether the Prefect API that a call will use answers, asked before anything starts.

A PREFECT_API_URL (from the environment, or the active Prefect profile) that names a server which
is not running would otherwise fail deep in Prefect's client, after its retries, in a traceback
of a hundred lines ("Failed to reach API"). `check_reachable()` fails at once instead, with one
line that names the setting, its value and the two fixes: start the server, or leave the
profile (unset the variable) so that Prefect starts a temporary server of its own.

Asked by a Python call of the flow (and so `TorchTrainer.fit()`), by the command line before it
trains, and by the commands that talk to a server (`ft-train automations install`,
`ft-train deploy`). Not inside a flow or task run: the API that runs it answers.
"""

from __future__ import annotations

import os

import httpx
from prefect.context import FlowRunContext, TaskRunContext, get_settings_context
from prefect.settings import PREFECT_API_URL

from ft_train.errors import ConfigError

# How long a server that accepts the connection may take to answer /health. A port with nothing
# listening is refused at once; a host that drops packets costs this long.
HEALTH_TIMEOUT_S = 10.0


class PrefectApiUnreachable(ConfigError):
    """PREFECT_API_URL names a Prefect API that does not answer. The message names the setting,
    its value and the fixes; nothing has started."""


def check_reachable(timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Return where no API is set (Prefect's ephemeral mode), inside a flow or task run, or where
    the API answers; raise PrefectApiUnreachable where it cannot be reached. Any HTTP answer
    counts as reachable (an API that answers /health with an error is Prefect's to report)."""
    url = PREFECT_API_URL.value()
    if not url or FlowRunContext.get() is not None or TaskRunContext.get() is not None:
        return
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.TransportError as e:
        raise PrefectApiUnreachable(unreachable_message(url, e)) from None


def unreachable_message(url: str, error: Exception) -> str:
    """One line: the setting and its value, why, and the two fixes, naming where it is set."""
    if "PREFECT_API_URL" in os.environ:
        leave = "or unset PREFECT_API_URL to have Prefect start a temporary server"
        where = "the environment"
    else:
        profile = get_settings_context().profile.name
        leave = (
            "or leave the profile (prefect profile use ephemeral) to have Prefect start a "
            "temporary server"
        )
        where = f"Prefect profile {profile!r}"
    reason = str(error) or type(error).__name__
    return (
        f"the Prefect API at PREFECT_API_URL={url} (set in {where}) cannot be reached "
        f"({reason}): start that server (prefect server start), {leave}"
    )
