"""What ft-train uses of Prefect beyond its documented API, in one place.

`flows/ephemeral.py` starts Prefect's temporary API server itself, at the moment a Python call of
the flow begins (a cold start's longest part), the way Prefect starts it: the server's app factory
served by uvicorn, with two of Prefect's private settings (double underscore: not in its
documented settings) that make the process the temporary server rather than a client of one.
Prefect has no public call that starts that server without waiting for it. Checked on Prefect
3.9; pyproject.toml bounds prefect below 3.10. `tests/unit/test_private_apis.py` checks each name
on the version installed.

Not private, and so not here: the flow is a subclass of Prefect's public `Flow` overriding its
public `__call__`, so that a Python call checks its input before Prefect starts anything.
"""

from __future__ import annotations

# uvicorn's import string for the app Prefect's own `prefect server start` serves
SERVER_APP = "prefect.server.api.server:create_app"

# the environment Prefect's temporary server process starts with (besides the UI turned off)
EPHEMERAL_SERVER_ENV = {"PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}

# What tests/unit/test_private_apis.py checks: (object path, attribute).
PRIVATE_NAMES = (
    ("prefect.server.api.server", "create_app"),
    ("prefect.settings.Settings (env name)", "PREFECT__SERVER_EPHEMERAL"),
    ("prefect.settings.Settings (env name)", "PREFECT__SERVER_FINAL"),
)
