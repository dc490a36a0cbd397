"""Credentials given to ft-train are stored nowhere: not in Prefect (flow-run parameters, task
runs, logs, artifacts, events, nor the bytes of its database) and not under the run's storage.

The loopback S3 endpoint checks access keys here (`moto_checks_credentials`), and each way of
giving them (a prefect-aws AwsCredentials block, a Secret block, storage_options in a Python
call, the environment) gets keys of its own, which nothing else holds: a run that finishes used
the keys planted for it, and a scan that finds none of them shows they were kept out.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from fastapi.encoders import jsonable_encoder

import ft_train
from ft_train.storage.credentials import MASK
from ft_train.storage.fs import Storage
from tests.conftest import make_s3_target, moto_checks_credentials
from tests.helpers import DEMO, demo_config, stored_by_prefect

pytestmark = pytest.mark.usefixtures("prefect_api")


# -- the config ------------------------------------------------------------------------------


def test_credentials_in_storage_options_are_masked_wherever_the_config_is_encoded():
    run = ft_train.RunConfig(
        name="r",
        storage_path="s3://b",
        storage_options={
            "endpoint_url": "http://e",
            "secret": "planted-1",
            "client_kwargs": {"aws_session_token": "planted-2", "region_name": "eu-west-1"},
        },
    )
    for encoded in (
        run.model_dump_json(),
        json.dumps(jsonable_encoder(run)),  # how Prefect stores a flow run's parameters
        json.dumps(jsonable_encoder({"run_config": run})),
        repr(run),
        str(run),
    ):
        assert "planted" not in encoded, encoded
    assert jsonable_encoder(run)["storage_options"]["secret"] == MASK
    assert "eu-west-1" in run.model_dump_json()  # not a credential: shown
    options = Storage(run.storage_path, run.storage_options).options
    assert options["secret"] == "planted-1"
    assert options["client_kwargs"]["aws_session_token"] == "planted-2"


def test_a_masked_credential_is_refused_naming_the_block_way():
    """A config copied from Prefect's UI holds the mask where the credential was."""
    with pytest.raises(ft_train.ConfigError) as err:
        ft_train.config.parse(
            ft_train.RunConfig,
            {"name": "r", "storage_options": {"key": "AKIA1", "secret": MASK}},
            "run_config",
        )
    message = str(err.value)
    assert "run_config.storage_options.secret" in message and "credentials_block" in message


def test_a_deployment_refuses_credentials_in_its_parameters_at_creation():
    """The flow's parameter schema: Prefect's server validates a deployment run's parameters
    against it when the run is created, before it stores them."""
    from prefect.utilities.schema_tools.validation import validate

    from flows.train import train

    schema = train.parameters.model_dump()
    ok = {"train_loop": DEMO, "run_config": {"name": "r", "storage_options": {"endpoint_url": "e"}}}
    bad = {"train_loop": DEMO, "run_config": {"name": "r", "storage_options": {"secret": "x"}}}
    validate(ok, schema, raise_on_error=True)
    with pytest.raises(Exception, match="secret"):
        validate(bad, schema, raise_on_error=True)


def test_a_missing_block_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "runs")
    with pytest.raises(ft_train.ConfigError, match="run_config.credentials_block 'no-such'"):
        _train(path, {}, "no-block", credentials_block="no-such")
    assert not os.path.exists(path)  # refused before anything was written


def _train(path: str, options: dict, name: str, **kw) -> ft_train.TrainResult:
    from flows.train import train

    return train(
        train_loop=DEMO,
        train_loop_config=demo_config(),
        scaling_config=ft_train.ScalingConfig(num_workers=2),
        run_config=ft_train.RunConfig(name=name, storage_path=path, storage_options=options, **kw),
    )


# -- a planted secret, stored nowhere ----------------------------------------------------------


def _access_key(endpoint: str, user: str) -> tuple[str, str]:
    """An IAM user of the loopback endpoint allowed everything on S3: its (key id, secret)."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
    iam.create_user(UserName=user)
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
    }
    arn = iam.create_policy(PolicyName=f"{user}-s3", PolicyDocument=json.dumps(policy))
    iam.attach_user_policy(UserName=user, PolicyArn=arn["Policy"]["Arn"])
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def test_a_planted_secret_is_stored_nowhere(s3_endpoint, monkeypatch):
    from prefect.blocks.system import Secret
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    target = make_s3_target(s3_endpoint)
    endpoint = {"endpoint_url": s3_endpoint}
    keys = {how: _access_key(s3_endpoint, f"{how}-{time.time_ns()}") for how in WAYS}
    AwsCredentials(
        aws_access_key_id=keys["aws"][0],
        aws_secret_access_key=keys["aws"][1],
        aws_client_parameters=AwsClientParameters(endpoint_url=s3_endpoint),
    ).save("ft-planted-aws", overwrite=True)
    Secret(value={"key": keys["secret"][0], "secret": keys["secret"][1]}).save(
        "ft-planted", overwrite=True
    )
    plain = {**endpoint, "key": keys["plain"][0], "secret": keys["plain"][1]}
    given = {
        "aws": ({}, "aws-credentials/ft-planted-aws"),
        "secret": (endpoint, "secret/ft-planted"),
        "plain": (plain, None),
        "env": (endpoint, None),
    }
    with moto_checks_credentials():
        for how in WAYS:  # the ranks' processes start per run: they inherit the environment
            env_key = keys["env"] if how == "env" else ("no-such-key", "no-such-secret")
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", env_key[0])
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_key[1])
            options, block = given[how]
            result = _train(target.path, options, f"planted-{how}", credentials_block=block)
            assert result.status == "finished" and result.checkpoint is not None, how

    planted = [v for pair in keys.values() for v in pair]
    names = [f"planted-{how}" for how in WAYS]
    found = {what: text for what, text in stored_by_prefect(names).items() if _any(planted, text)}
    assert not found, f"a credential is stored by Prefect in {sorted(found)}"
    for path, data in _stored_under(target, plain).items():
        assert not _any(planted, data.decode(errors="replace")), path
    # but an AwsCredentials block's aws_access_key_id, which prefect-aws stores as plain text
    # (its id, not its secret): the block is where it belongs
    assert _prefect_database_holds_none_of([v for v in planted if v != keys["aws"][0]])


WAYS = ("aws", "secret", "plain", "env")


def _any(planted: list[str], text: str) -> bool:
    return any(p in text for p in planted)


def _stored_under(target, options) -> dict[str, bytes]:
    """Every object in the test's bucket (the runs, their states, leases, checkpoints)."""
    storage = Storage(target.path, options)
    bucket = target.path.removeprefix("s3://").split("/")[0]
    paths = storage.fs.find(bucket)
    assert any(p.endswith("run_state.json") for p in paths) and any(
        p.endswith("driver_lease.json") for p in paths
    )
    return storage.fs.cat(paths)


def _prefect_database_holds_none_of(planted: list[str]) -> bool:
    """The raw bytes of the Prefect server's database (SQLite, and its write-ahead log): a
    stored block's secret fields are encrypted there; nothing else may hold a credential."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    path = PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1]
    for name in (path, f"{path}-wal"):
        if os.path.exists(name):
            with open(name, "rb") as f:
                data = f.read()
            for p in planted:
                assert p.encode() not in data, f"{p[:4]}... in {name}"
    return True
