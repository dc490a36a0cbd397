"""User-facing configuration: pydantic models that are also the Prefect flow's parameters.

Each model is frozen, each field has a description (the Prefect UI renders it as the form's help),
and each validation error names the field and the fix. Validation happens in the driver before any
worker starts, so bad input never reaches the cluster or the run's stored state.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from . import callbacks as user_callbacks
from . import ray_names, run_name
from .cluster_config import ClusterConfig
from .errors import ConfigError
from .storage import credentials

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "FailureConfig",
    "RunConfig",
    "ScalingConfig",
    "name_of",
    "parse",
]

DEFAULT_STORAGE_PATH = "~/ft_train_results"

# A run name becomes one path segment under storage_path: it must not be able to leave it.
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+,@:-]{0,199}$")
# ... or it is a template with {scheduled_start:FORMAT} fields (`run_name.py`): checked rendered.
_FIELD = r"\{scheduled_start(?::[A-Za-z0-9%._=+,@:-]*)?\}"
_NAME_OR_TEMPLATE = rf"^(?:[A-Za-z0-9]|{_FIELD})(?:[A-Za-z0-9._=+,@:-]|{_FIELD}){{0,199}}$"


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Ray Train's fields that ft-train does not offer are refused by name, with what to use
    # instead (`ray_names`), not as a misspelling. Pydantic calls a model's own __init__ also to
    # validate a dict (a flow parameter, a nested config): there the ConfigError comes wrapped
    # in a ValidationError, which `parse` unwraps.
    def __init__(self, **data: Any) -> None:
        refused = ray_names.refused_field(type(self).__name__, data)
        if refused is not None:
            raise ConfigError(refused)
        super().__init__(**data)


class ScalingConfig(_Config):
    """How many ranks to run, and on what."""

    num_workers: int | tuple[int, int] = Field(
        1,
        description="Training ranks, one per Dask worker: a number, or (min, max) for an elastic "
        "group that starts with at least min, goes on with fewer after a loss, grows back to max.",
    )
    elastic_wait_s: float = Field(
        10.0,
        ge=0,
        description="Elastic only: how long a (re)start waits for max workers before it starts "
        "with the min or more that are there.",
    )
    use_gpu: bool = Field(
        False,
        description="One GPU per rank (NCCL); workers need a `GPU` resource or a visible GPU.",
    )
    worker_start_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long to wait for enough Dask workers before a (re)start gives up.",
    )

    @field_validator("num_workers")
    @classmethod
    def _sizes(cls, n: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (n, n) if isinstance(n, int) else n
        if not 1 <= low <= high:
            raise ValueError(
                f"scaling_config.num_workers {n!r}: give a number >= 1, or (min, max) with "
                "1 <= min <= max"
            )
        return n

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]


_GRACE_IS_RAYS = (
    "preemption_grace_s is Ray Train's setting: how long the ranks that stay may keep running "
    "past a preemption's deadline; ft-train stops the group at the deadline (Ray's default, 0), "
    "so only 0 is accepted. The time a worker told to leave stays for a just-in-time "
    "checkpoint, which ft-train named preemption_grace_s before, is now "
    "failure_config.preemption_notice_s"
)


class FailureConfig(_Config):
    """How many worker-group failures the run survives."""

    max_failures: int = Field(
        0,
        ge=-1,
        description="Restarts after a rank or worker failure: 0 = none, -1 = unlimited. "
        "Driver crashes do not count.",
    )
    max_driver_restarts: int = Field(
        3,
        ge=-1,
        description="Driver crashes (its flow process killed, its machine gone) the run survives "
        "before a rerun fails it: -1 = unlimited. Counted in the run's stored state, so a rerun "
        "loop stops whatever starts the reruns; a rerun of a failed run counts afresh.",
    )
    max_preemption_failures: int = Field(
        -1,
        ge=-1,
        description="Restarts after a worker was told to leave (SIGTERM): -1 = unlimited. "
        "They do not count toward max_failures.",
    )
    preemption_notice_s: float = Field(
        30.0,
        ge=0,
        description="How long a worker told to leave (SIGTERM, Client.retire_workers) stays, for "
        "the ranks to save a just-in-time checkpoint (they learn of it within "
        "agreement_interval_s of report()/get_preemption_info() calls). ft-train's setting; "
        "before it was named preemption_grace_s.",
    )
    preemption_grace_s: float = Field(
        0.0,
        ge=0,
        description="Ray Train's setting: how long the ranks that stay may keep running past a "
        "preemption's deadline. ft-train stops the group at the deadline, Ray's default: only 0.",
    )
    agreement_interval_s: float = Field(
        0.25,
        ge=0,
        description="The ranks agree on what they must all learn at the same call of report() or "
        "get_preemption_info() (a worker leaving, the driver's stop) at calls about this far "
        "apart (at most 16 calls): they learn of it within this long, plus one call. 0: at "
        "every call, which costs ~0.3 ms a call on a busy CPU.",
    )
    hang_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="A rank that makes no report() for this long (from its group's start or its "
        "last report) is hung: the group restarts. Collectives time out a little earlier. "
        "None: no watchdog (collectives keep torch's 30-minute timeout).",
    )

    @field_validator("preemption_grace_s")
    @classmethod
    def _ray_grace(cls, grace_s: float) -> float:
        if grace_s != 0:
            raise ValueError(_GRACE_IS_RAYS)
        return grace_s

    @property
    def collective_timeout_s(self) -> float:
        """Below the watchdog's, so a rank stuck in a collective fails before it is killed."""
        return 1800.0 if self.hang_timeout_s is None else 0.8 * self.hang_timeout_s


class CheckpointConfig(_Config):
    """Which committed checkpoints to keep."""

    num_to_keep: int | None = Field(
        None, ge=1, description="Checkpoints to keep; the latest is always kept. None keeps all."
    )
    checkpoint_score_attribute: str | None = Field(
        None, description="Metric that ranks checkpoints for retention; None keeps the newest."
    )
    checkpoint_score_order: Literal["max", "min"] = Field(
        "max", description="Whether a higher ('max') or lower ('min') score is better."
    )
    snapshot_every: int | None = Field(
        None,
        ge=1,
        description="Every this many reports, the state given to report(snapshot=...) is held "
        "in a peer worker's memory; a restart resumes from the newest snapshot every rank's of "
        "which survived, when newer than the latest checkpoint. None: no snapshots.",
    )


class RunConfig(_Config):
    """The identity of a run, `(storage_path, name)`, and how it treats failures and checkpoints."""

    name: str | None = Field(
        None,
        description="Unique run id. A flow run with the same storage_path and name resumes this "
        "run. May hold {scheduled_start:%Y%m%d-%H%M} (strftime codes): each scheduled run of a "
        "deployment is then a run of its own, named after its slot. None (as in Ray): each flow "
        "run generates a name of its own, 'ft_train_run-%Y-%m-%d_%H-%M-%S-<its id>' (the flow "
        "run is named so, and a rerun of it after a driver crash resumes it); give one to "
        "resume the run from another flow run.",
        # in the JSON schema too, so a deployment run with a bad name is refused at creation
        json_schema_extra={"pattern": _NAME_OR_TEMPLATE},
    )
    storage_path: str = Field(
        DEFAULT_STORAGE_PATH,
        validate_default=True,
        description="Where runs live: a local path or any fsspec URL (s3://bucket/prefix).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        description="Options for the fsspec filesystem (endpoint_url, ...). Credentials: "
        "give credentials_block, or the environment's (AWS_* variables); in a Python call, "
        "key/secret/token here are held hidden, and Prefect stores '**********' for them. A "
        "deployment refuses them: Prefect would store them with the run's parameters.",
        # a deployment run that holds credentials is refused by Prefect's server at creation
        json_schema_extra={"propertyNames": {"not": {"pattern": credentials.CREDENTIAL.pattern}}},
    )
    credentials_block: str | None = Field(
        None,
        description="A Prefect block with the storage's credentials, read by the driver when "
        "the run starts and never stored: 'secret/NAME' (a Secret whose value is a JSON object "
        'of fsspec options, e.g. {"key": ..., "secret": ...}; a bare NAME means this) or '
        "'aws-credentials/NAME' (prefect-aws). Laid over storage_options.",
    )
    failure_config: FailureConfig = Field(default_factory=FailureConfig)
    checkpoint_config: CheckpointConfig = Field(default_factory=CheckpointConfig)
    resume: Literal["auto", "never", "must"] = Field(
        "auto",
        description="What to do with a run of this name that exists: 'auto' resumes it, or "
        "starts the run if there is none; 'never' refuses to start if it exists; 'must' refuses "
        "unless it exists.",
    )
    callbacks: list[Any] = Field(
        default_factory=list,
        description="Driver-side callbacks (ft_train.UserCallback: Ray's after_report and "
        "after_exception, ft-train's after_checkpoint, after_failure, after_run_end), e.g. "
        "'ft_train.integrations.mlflow:MLflowCallback'. Each an import path 'pkg.mod:Callback', "
        "or {'callback': 'pkg.mod:Callback', 'kwargs': {...}}, or (a Python call) an instance. "
        "They run in the driver, off the controller's thread; one that raises is logged and "
        "never fails the run. Credentials in kwargs (a token, a password, a URL with a "
        "password): in a Python call they are held hidden, and Prefect stores '**********'; a "
        "deployment refuses them: give them in the driver's environment (MLFLOW_TRACKING_TOKEN, "
        "...).",
        # a deployment run whose callback kwargs hold credentials is refused by Prefect's server
        json_schema_extra={
            "items": {
                "anyOf": [
                    {"type": "string", "pattern": r"^[^:\s]+:[^:\s]+$"},
                    {
                        "type": "object",
                        "properties": {
                            "callback": {"type": "string", "pattern": r"^[^:\s]+:[^:\s]+$"},
                            "kwargs": {
                                "type": "object",
                                "propertyNames": {
                                    "not": {"pattern": credentials.CREDENTIAL.pattern}
                                },
                                # nor a URL that holds a password (http://user:password@host)
                                "additionalProperties": {
                                    "not": {
                                        "type": "string",
                                        "pattern": user_callbacks.URL_PASSWORD.pattern,
                                    }
                                },
                            },
                        },
                        "required": ["callback"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
    )
    allow_train_loop_change: bool = Field(
        False,
        description="Resume a run that exists with a train_loop or train_loop_config other than "
        "the one it last trained with; a finished run then trains on from its final checkpoint "
        "(e.g. more epochs). False refuses the change before any worker starts, naming each "
        "changed field.",
    )

    @field_validator("name")
    @classmethod
    def _name_stays_inside_storage(cls, name: str | None) -> str | None:
        if name is None:
            return None  # generated by the driver (`run_name.generate`): valid by construction
        rendered = run_name.render(name, run_name.SAMPLE)  # a template: as it will be named
        if ".." in rendered or not _NAME_OK.fullmatch(rendered):
            raise ValueError(
                f"run_config.name {name!r} is not a valid run name: use 1-200 characters from "
                "letters, digits and . _ = + , @ : -, starting with a letter or digit, with no '/' "
                "or '..' (the name is one directory under storage_path), e.g. "
                "'unique_run_id=da823d5'; in a template only {scheduled_start:FORMAT} fields, "
                "with strftime codes, e.g. 'nightly-{scheduled_start:%Y%m%d-%H%M}'."
            )
        return name

    @model_validator(mode="after")
    def _must_resume_a_name(self) -> RunConfig:
        # A generated name is new in every flow run: 'must' would refuse every one of them.
        if self.resume == "must" and self.name is None:
            raise ValueError(
                "run_config.resume='must' resumes a run that exists, by its name, and "
                "run_config.name is not given (a generated name is a new run's): give the name "
                "of the run to resume, or set resume='auto'"
            )
        return self

    @field_validator("storage_options")
    @classmethod
    def _credentials_hidden(cls, options: dict[str, Any]) -> dict[str, Any]:
        copied = credentials.masked(options)
        if copied:
            raise ValueError(
                f"run_config.storage_options.{copied[0]} is {credentials.MASK!r}, the mask "
                "Prefect shows in a credential's place, not the credential: name a block "
                "holding it in run_config.credentials_block, or set it in the environment"
            )
        return credentials.hide(options)

    @field_validator("callbacks", mode="before")
    @classmethod
    def _callback_forms(cls, items: Any) -> list[Any]:
        # The form only: the import happens in the driver (`ft_train.callbacks.load`), where
        # the callback runs; a config may be built where its module is not installed.
        if not isinstance(items, (list, tuple)):
            raise ValueError(
                "run_config.callbacks: give a list of callbacks, e.g. "
                "['ft_train.integrations.mlflow:MLflowCallback']"
            )
        return [
            user_callbacks.check_form(item, f"run_config.callbacks[{i}]")
            for i, item in enumerate(items)
        ]

    @field_serializer("callbacks", when_used="json")
    def _callbacks_shown(self, items: list[Any]) -> list[Any]:
        return [user_callbacks.describe(item) for item in items]  # an instance by its class

    @field_validator("credentials_block")
    @classmethod
    def _block_name(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"([a-z0-9-]+/)?[^/\s]+", name):
            raise ValueError(
                f"run_config.credentials_block {name!r}: give a block's name as "
                "'secret/NAME' or 'aws-credentials/NAME'"
            )
        return name

    @field_validator("storage_path")
    @classmethod
    def _absolute_storage_path(cls, path: str) -> str:
        path = path.strip()
        if not path:
            raise ValueError(
                "run_config.storage_path is empty: give a local directory or a URL like s3://bucket/"
            )
        if "://" in path:
            return path.rstrip("/") if not path.endswith("://") else path
        # Ranks may run with another working directory: pin a local path down here, once.
        return os.path.abspath(os.path.expanduser(path))


def name_of(run_config: RunConfig) -> str:
    """The run's name, which the driver works on: given, or generated by the flow run for a run
    given none (`flows.train.named`, before anything reads it). ConfigError outside one."""
    if run_config.name is None:
        raise ConfigError(
            "run_config.name is not given, and a name is generated only in a flow run (the "
            "ft-train flow called, TorchTrainer.fit(), or a deployment run): give run_config.name"
        )
    return run_config.name


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], value: Any, parameter: str) -> M:
    """The flow parameter `parameter` as a `model`: a config as it is, or a dict (as a
    deployment run or a Python call may pass it) validated into one. Raises ConfigError naming
    each bad field, with its fix."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        problems: dict[str, str] = {}
        for error in e.errors():
            where, about = _field(model, parameter, error["loc"])
            problem = _problem(where, about, error)
            if error["type"] == "extra_forbidden":
                problem += _belongs(model, parameter, str(error["loc"][-1]))
            problems.setdefault(where, problem)  # a union's first
        raise ConfigError(f"invalid {parameter}: " + "; ".join(problems.values())) from None


def _problem(where: str, about: str | None, error: ErrorDetails) -> str:
    if error["type"] == "extra_forbidden":
        return (
            f"{where}: there is no such setting; check its spelling, and that it belongs "
            f"in {where.rsplit('.', 1)[0]}"
        )
    message = error["msg"].removeprefix("Value error, ")
    about = about.rstrip(".") if about else about
    if isinstance(error.get("ctx", {}).get("error"), ConfigError):
        # ours: it names the setting and the fix; never the input, which may hold credentials
        return f"{where}: {message}"
    if message.startswith(where):
        return message  # our own validators name the field and the fix already
    # never echo storage_options: they may hold credentials
    got = "" if "storage_options" in where else f" (got {error.get('input')!r})"
    return f"{where}: {message}{got}" + (f". {about}" if about else "")


def _field(model: type[BaseModel], parameter: str, loc: tuple) -> tuple[str, str | None]:
    """The dotted name of the field at `loc` (a union's member left out), and its description
    (it says what the values mean: the fix)."""
    names, about = [parameter], None
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            if names[-1] == parameter or about is None:
                names.append(str(part))  # a dict key or an unknown field
            break
        names.append(part)
        about = field.description
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
    return ".".join(names), about


def _belongs(model: type[BaseModel], path: str, name: str) -> str:
    """Where a setting called `name` is, if it is in a config nested in `model`."""
    for field_name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            here = f"{path}.{field_name}"
            if name in field.annotation.model_fields:
                return f" (it is a setting of {here})"
            found = _belongs(field.annotation, here, name)
            if found:
                return found
    return ""
