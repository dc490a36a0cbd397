"""Credentials among fsspec storage options: which options are credentials, held hidden.

`RunConfig.storage_options` is a flow parameter, and Prefect stores a flow run's parameters (and
shows them in the UI). An option whose name says it is a credential (s3fs's key, secret, token;
botocore's aws_*_key*; gcsfs's token; adlfs's account_key, sas_token, client_secret, ...) is
held as a pydantic `Secret` wherever it sits in the options: every JSON encoding of the config,
Prefect's included, and every repr show MASK instead. `reveal` gives fsspec the plain values,
in memory only (`Storage`), and through the Dask task to the ranks.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Secret

# Matched against option names, at any depth (client_kwargs.aws_secret_access_key too). Broad on
# purpose: hiding a name that is no credential (an SSE-KMS key id) costs only its display.
CREDENTIAL = re.compile(r"secret|token|password|passwd|credential|connection_string|key", re.I)
MASK = "**********"  # what pydantic writes for a Secret, and so what Prefect stores


def hide(options: Any) -> Any:
    """`options` with every credential's value as a `Secret` (those already hidden kept)."""
    if not isinstance(options, dict):
        return options
    return {
        k: _secret(v) if isinstance(k, str) and CREDENTIAL.search(k) else hide(v)
        for k, v in options.items()
    }


def reveal(options: Any) -> Any:
    """`options` with every `Secret` replaced by its value: what fsspec is given."""
    if isinstance(options, Secret):
        return reveal(options.get_secret_value())
    if isinstance(options, dict):
        return {k: reveal(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return type(options)(reveal(v) for v in options)
    return options


def masked(options: Any, where: str = "") -> list[str]:
    """Dotted names of the credentials in `options` whose value is MASK: copied from where
    Prefect shows them, not the credentials themselves."""
    found = []
    for k, v in options.items() if isinstance(options, dict) else ():
        name = f"{where}.{k}" if where else str(k)
        if reveal(v) == MASK:
            found.append(name)
        elif isinstance(v, dict):
            found += masked(v, name)
    return found


def hidden(options: Any) -> list[str]:
    """Dotted names of the credentials held in `options` (hidden ones)."""
    found = []
    for k, v in options.items() if isinstance(options, dict) else ():
        if isinstance(v, Secret):
            found.append(str(k))
        elif isinstance(v, dict):
            found += [f"{k}.{n}" for n in hidden(v)]
    return found


def _secret(value: Any) -> Any:
    if value is None or isinstance(value, Secret):
        return value
    return Secret(value)
