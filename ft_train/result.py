"""`TrainResult`: what a run produced, rebuilt from the run state alone (no Prefect needed).
Unlike a rerun, it reads the whole checkpoint index (the head and its sealed chunks).

Ray Train's `Result` names mean what they mean in Ray:

    metrics             the latest committed checkpoint's metrics (None without a checkpoint)
    checkpoint          the latest committed checkpoint
    best_checkpoints    the kept checkpoints with their metrics: ascending by score when
                        `checkpoint_score_attribute` is set (the best last), else in report
                        order; at most `num_to_keep`
    metrics_dataframe   a row per entry of best_checkpoints (pandas)
    get_best_checkpoint(metric, mode)   among best_checkpoints, by that metric
    path                the run's directory, `{storage_path}/{name}`; ft-train keeps the URL's
                        scheme (s3://...), which `from_path` takes back
    error               the run's TrainingFailedError (WorkerGroupError when max_failures was
                        spent on worker failures); None unless it failed
    return_value        rank 0's return value of the training function, on the result of the
                        flow call that finished the run; None from `from_path` and from a call
                        that trained nothing (the run had finished): it is never stored
    from_path(path)     the result of the run at `path`

ft-train's own: `last_metrics` (the last report of a finished run, else the latest
checkpoint's), `metrics_history` (every reported number by step, bounded; `history_dataframe`),
`failures`, `status`. Ray's `filesystem` (a pyarrow filesystem) is refused, naming fsspec
(`ft_train.ray_names`): ft-train reads storage through fsspec, with the run's `storage_options`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .config import CheckpointConfig
from .errors import ConfigError, StorageError, TrainingFailedError, WorkerGroupError
from .policy.failure import worker_failures
from .ray_names import RefusesRayNames
from .storage.checkpoint import Checkpoint
from .storage.checkpoint_manager import score
from .storage.fs import Storage
from .storage.metric_history import MetricHistory, Point, load_history
from .storage.run_state import CheckpointEntry, FailureRecord, RunState, RunStore


@dataclass
class TrainResult(RefusesRayNames):
    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]]
    path: str
    error: TrainingFailedError | None
    failures: list[FailureRecord] = field(default_factory=list)
    status: str = "running"
    # The reported numeric metrics by step, at a bounded size (`storage.metric_history`).
    metrics_history: list[Point] = field(default_factory=list)
    # The run's last reported metrics if it finished, else its latest checkpoint's.
    last_metrics: dict[str, Any] | None = None
    # In memory only (it need not be JSON): the flow's result carries it, `from_path` cannot.
    return_value: Any = field(default=None, repr=False)

    @property
    def metrics_dataframe(self) -> Any:
        """Ray's: a pandas DataFrame with a row of metrics per entry of `best_checkpoints`."""
        return _dataframe([m for _, m in self.best_checkpoints], "metrics_dataframe")

    @property
    def history_dataframe(self) -> Any:
        """`metrics_history` as a pandas DataFrame: every reported number, by step."""
        return _dataframe(self.metrics_history, "history_dataframe")

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """Ray's: the checkpoint of `best_checkpoints` whose `metric` is highest (`mode="max"`)
        or lowest ("min"); the checkpoints without that metric are left out. None if none has
        it (Ray's documented answer; its code raises RuntimeError there)."""
        if mode not in ("max", "min"):
            raise ConfigError(f"get_best_checkpoint(mode={mode!r}): mode must be 'max' or 'min'")
        having = [(c, m[metric]) for c, m in self.best_checkpoints if metric in m]
        if not having:
            return None
        pick = max if mode == "max" else min
        return pick(having, key=lambda cm: cm[1])[0]

    @classmethod
    def from_state(
        cls,
        storage: Storage,
        state: RunState,
        cfg: CheckpointConfig | None = None,
        *,
        entries: list[CheckpointEntry] | None = None,
        history: MetricHistory | None = None,
    ) -> TrainResult:
        """The result of `state`'s run on `storage`. `cfg`: how its checkpoints are ranked;
        by default the checkpoint config the run last trained with (as its state records).
        `entries` (`RunStore.all_checkpoints`) and `history`: what the caller has already read
        or kept, so that the end of a run reads each once; each is read here when not given."""

        def ckpt(dir_name: str) -> Checkpoint:
            return Checkpoint(storage.uri(f"{state.name}/{dir_name}"), storage.options)

        cfg = cfg or _recorded_checkpoint_config(state)
        if entries is None:
            entries = RunStore(storage, state.name).all_checkpoints(state)
        entries = sorted(entries, key=lambda e: e.report_index)  # report order; not the caller's
        if cfg.checkpoint_score_attribute is not None:
            entries.sort(key=lambda e: (score(e, cfg), e.report_index))  # the best last
        if cfg.num_to_keep is not None:
            entries = entries[-cfg.num_to_keep :]  # the latest is kept on storage even if worse
        latest = state.latest_entry()
        if history is None:
            try:
                history = load_history(storage, state.name)
            except Exception:  # it only informs (damaged, or storage out); the state is the record
                history = MetricHistory()
        return cls(
            metrics=dict(latest.metrics) if latest else None,
            checkpoint=ckpt(latest.dir_name) if latest else None,
            best_checkpoints=[(ckpt(e.dir_name), e.metrics) for e in entries],
            path=storage.uri(state.name),
            error=_error(state),
            failures=list(state.failures),
            status=state.status,
            metrics_history=history.rows(),
            last_metrics=state.metrics,
        )

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike,
        name: str | None = None,
        storage_options: dict[str, Any] | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        *,
        storage_filesystem: Any = None,
    ) -> TrainResult:
        """The result of a run, finished or not: `from_path(result.path)` (Ray's form: the
        run's directory, a local path or a URL such as s3://bucket/prefix/name, or a PathLike)
        or `from_path(storage_path, name)`. `storage_options`: fsspec's (endpoint_url, ...),
        in either form; `checkpoint_config`: how to rank the checkpoints, if not as the run
        last trained. Ray's `storage_filesystem` (pyarrow) is refused: give storage_options."""
        from .config import RunConfig

        if storage_filesystem is not None or not (name is None or isinstance(name, str)):
            raise TypeError(
                "TrainResult.from_path: a pyarrow filesystem (Ray's storage_filesystem) is not "
                "taken; give the run's path as a URL (s3://bucket/prefix/name) and fsspec's "
                "options as storage_options= (e.g. {'endpoint_url': ...})"
            )
        if name is None:
            storage_path, name = split_run_path(path)
        else:
            storage_path = os.fspath(path)
        cfg = RunConfig(name=name, storage_path=storage_path)  # validates and normalises
        storage = Storage(cfg.storage_path, storage_options)
        state = RunStore(storage, name).load()
        if state is None:
            raise StorageError(f"no run named {name!r} under {cfg.storage_path}")
        return cls.from_state(storage, state, checkpoint_config)


def split_run_path(path: str | os.PathLike) -> tuple[str, str]:
    """A run's directory (`TrainResult.path`) as (storage_path, name): its parent and its last
    part. A trailing '/' is ignored; a local path is made absolute."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"TrainResult.from_path: give the run's path as a str, not {text!r}")
    if "?" in text:
        raise ConfigError(
            f"TrainResult.from_path({text!r}): query parameters are not read; give the "
            "filesystem's options as storage_options= (e.g. {'endpoint_url': ...})"
        )
    if "://" in text:
        scheme, rest = text.split("://", 1)
        parent, _, name = rest.rstrip("/").rpartition("/")
        if not parent or not name:
            raise ConfigError(
                f"TrainResult.from_path({text!r}): that is no run's directory; give "
                f"{scheme}://bucket/prefix/name (the result's path), or (storage_path, name)"
            )
        return f"{scheme}://{parent}", name
    local = os.path.abspath(os.path.expanduser(text))
    parent, name = os.path.split(local)
    if not name:
        raise ConfigError(
            f"TrainResult.from_path({text!r}): that is no run's directory; give "
            "storage_path/name (the result's path), or (storage_path, name)"
        )
    return parent, name


def _recorded_checkpoint_config(state: RunState) -> CheckpointConfig:
    """The checkpoint config the run last trained with; the default if its state predates
    that record (or holds one this ft-train cannot read)."""
    recorded = (state.config or {}).get("checkpoint_config")
    try:
        return CheckpointConfig.model_validate(recorded or {})
    except Exception:
        return CheckpointConfig()


def _error(state: RunState) -> TrainingFailedError | None:
    """The error a failed run ended with, as the flow raised it: WorkerGroupError, with its
    worker_failures rebuilt from the failure records, or TrainingFailedError."""
    if state.status != "failed":
        return None
    recent = state.failures[state.budget_start :]
    recorded = [f.model_dump(mode="json") for f in recent]
    message = state.error or "failed"
    charged = [f for f in recent if f.charged]
    if state.error_type == WorkerGroupError.__name__ and charged:
        return WorkerGroupError(
            message, worker_failures(state.failures, charged[-1].attempt), recorded
        )
    return TrainingFailedError(message, recorded)


def _dataframe(rows: list[Any], name: str) -> Any:
    try:
        import pandas  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError(
            f"TrainResult.{name} needs pandas (pip install pandas); best_checkpoints and "
            "metrics_history hold the same rows as dicts"
        ) from None
    return pandas.DataFrame(rows)
