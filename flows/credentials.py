"""The storage's credentials from a Prefect block (`RunConfig.credentials_block`), read in the
driver when a flow run starts.

They join the run's storage options in memory, hidden (`ft_train.storage.credentials`): the
flow run's stored parameters name the block, not what it holds; the ranks get them inside the
Dask task that runs them; nothing ft-train writes holds them. Two kinds of block:
- a Secret (`secret/NAME`, or a bare NAME) whose value is a JSON object of fsspec options,
  e.g. {"key": "AKIA...", "secret": "..."};
- prefect-aws's AwsCredentials (`aws-credentials/NAME`): its boto3 session's credentials (keys,
  a profile, an assumed role), region and endpoint, as s3fs options.
"""

from __future__ import annotations

import json
from typing import Any

from prefect.blocks.core import Block
from prefect.runtime import deployment

import ft_train
from ft_train.errors import ConfigError
from ft_train.storage import credentials


def with_credentials(run: ft_train.RunConfig) -> ft_train.RunConfig:
    """`run` with its block's credentials laid over its storage options (hidden). Refuses a
    deployment run whose parameters hold credentials: the Prefect server stored them with the
    run (a deployment created with enforce_parameter_schema=False lets them through)."""
    plain = credentials.hidden(run.storage_options)
    if plain and deployment.id:
        raise ConfigError(
            f"run_config.storage_options.{plain[0]} holds a credential, which the Prefect server "
            "stored with this deployment run's parameters: delete the flow run, keep the "
            "credential in a block named by run_config.credentials_block (e.g. "
            "'secret/s3-credentials') or in the workers' environment (AWS_* variables)"
        )
    refuse_callback_credentials(run)
    if run.credentials_block is None:
        return run
    options = dict(run.storage_options)
    for k, v in block_options(run.credentials_block).items():
        mine = options.get(k)
        options[k] = {**mine, **v} if isinstance(mine, dict) and isinstance(v, dict) else v
    return run.model_copy(update={"storage_options": credentials.hide(options)})


def refuse_callback_credentials(run: ft_train.RunConfig) -> None:
    """A deployment run whose callback kwargs hold a credential is refused, as storage options
    are: the Prefect server stored it with the run's parameters."""
    for i, item in enumerate(run.callbacks):
        kwargs = item.get("kwargs", {}) if isinstance(item, dict) else {}
        plain = credentials.hidden(kwargs)
        if plain and deployment.id:
            raise ConfigError(
                f"run_config.callbacks[{i}].kwargs.{plain[0]} holds a credential, which the "
                "Prefect server stored with this deployment run's parameters: delete the flow "
                "run, and give the credential in the environment of the process that runs the "
                "flow (e.g. MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_PASSWORD)"
            )


def block_options(name: str) -> dict[str, Any]:
    """The fsspec options that block `name` holds; ConfigError naming the fix if it cannot."""
    slug, _, document = name.rpartition("/")
    where = f"run_config.credentials_block {name!r}"
    try:
        block = Block.load(f"{slug or 'secret'}/{document}")
    except (ValueError, KeyError) as e:
        raise ConfigError(
            f"{where}: no such block ({e}); create it, e.g. Secret(value={{'key': ..., "
            f"'secret': ...}}).save({document!r}), or name an existing one"
        ) from None
    if hasattr(block, "get_boto3_session"):  # prefect-aws's AwsCredentials
        return _aws_options(block)
    value = block.get() if hasattr(block, "get") else None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where}: a {type(block).__name__} block whose value is not a JSON object of "
            'storage options; store e.g. {"key": "AKIA...", "secret": "..."} in it'
        )
    return value


def _aws_options(block: Any) -> dict[str, Any]:
    session = block.get_boto3_session()
    found = session.get_credentials()
    options: dict[str, Any] = {}
    if found is not None:
        frozen = found.get_frozen_credentials()
        options = {"key": frozen.access_key, "secret": frozen.secret_key}
        if frozen.token:
            options["token"] = frozen.token
    client_kwargs = {"region_name": session.region_name} if session.region_name else {}
    endpoint = getattr(block.aws_client_parameters, "endpoint_url", None)
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return options
