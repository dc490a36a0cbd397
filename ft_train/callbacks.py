"""Driver-side user callbacks: `UserCallback` (Ray Train's, with ft-train's hooks added), the
context each hook is given, and how an item of `RunConfig.callbacks` becomes a callback.

An item is one of three forms (DESIGN.md, "Frameworks and callbacks"):
- an import path, "pkg.mod:Callback" (a class, called with no arguments, or an instance);
- {"callback": "pkg.mod:Callback", "kwargs": {...}}: the class called with those keyword
  arguments (both forms are JSON: a deployment's parameters can hold them);
- an instance of a `UserCallback` subclass, in a Python call.

Hooks run in the driver (the flow's process), never on the ranks, each callback on a thread of
its own (`ft_train.driver.user_callbacks`): a slow or unreachable tracker never delays failure
detection or a commit, and a hook that raises is logged and never fails the run. Every hook is
called with keyword arguments, as Ray calls its own: an override MUST keep the parameter names.
A callback given by path is built in the driver, and once more before a Python call starts
anything (to refuse bad kwargs at once): its constructor SHOULD only keep its arguments, and
connect at its first hook.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .storage import credentials

if TYPE_CHECKING:
    from .storage.checkpoint import Checkpoint
    from .storage.run_state import FailureRecord

__all__ = [
    "URL_PASSWORD",
    "TrainRunContext",
    "UserCallback",
    "check_form",
    "describe",
    "hide",
    "load",
    "load_all",
]

# A URL that holds a password: scheme://user:password@host
URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


@dataclass(frozen=True)
class TrainRunContext:
    """What a hook knows of the run: Ray's `TrainRunContext` (run_config, train_loop_config,
    scaling_config, `get_run_config()`), and `path`, `{storage_path}/{name}`: the run's identity,
    the same for every attempt and every driver that trains it (Ray's `run_id` is new per
    controller; here it is the path)."""

    # an ft_train.RunConfig and ScalingConfig: typed Any, as ft_train.config imports this
    # module (to check RunConfig.callbacks' items) and the two must not import each other
    run_config: Any
    train_loop_config: dict[str, Any]
    scaling_config: Any
    path: str
    driver_run: int = 1  # this driver's number among those that trained the run (1: the first)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.path

    @property
    def name(self) -> str:
        return self.run_config.name or ""

    def get_run_config(self) -> Any:
        return self.run_config


class UserCallback:
    """A driver-side callback: override the hooks you need (`ft_train.UserCallback`, Ray's
    `ray.train.UserCallback`). Ray's two hooks keep Ray's names and signatures; the other three
    are ft-train's. A hook MUST NOT assume it runs on the controller's thread, and SHOULD return
    in a reasonable time: events wait in a bounded queue while it runs (reports beyond the bound
    are dropped, oldest first, with a warning; checkpoints, failures and the end never are)."""

    def after_report(
        self,
        run_context: TrainRunContext,
        metrics: list[dict[str, Any]],
        checkpoint: Checkpoint | None,
    ) -> None:
        """Every rank reported a round (Ray's hook). `metrics[i]` is rank i's metrics (a
        round recovered from the ranks' journals after a rank died has those of the ranks whose
        message survived); `checkpoint` the round's committed checkpoint, or None if no rank
        attached one.

        ft-train also passes `report_index=` (the round's index, from 1, the same across
        attempts and drivers) to an override that takes a parameter of that name (or
        **kwargs): `def after_report(self, run_context, metrics, checkpoint, report_index=0)`.
        Ray's signature alone works too. A round trained again after a restart (the reports
        after the checkpoint it resumed from) is reported again, with the same index."""

    def after_exception(
        self, run_context: TrainRunContext, worker_exceptions: dict[int, Exception]
    ) -> None:
        """A rank failed (Ray's hook): rank -> its error, a `ft_train.RankError` rebuilt from
        what the driver recorded (type name, message, traceback text; a process death or a
        lost node has no traceback). Called for every failure of a rank, retried or not."""

    def after_checkpoint(
        self,
        run_context: TrainRunContext,
        checkpoint: Checkpoint,
        report_index: int,
        metrics: dict[str, Any],
    ) -> None:
        """A checkpoint was committed at report `report_index` with rank 0's `metrics`: a
        restart resumes from it from now on."""

    def after_failure(
        self, run_context: TrainRunContext, failure: FailureRecord, failures_left: int | None
    ) -> None:
        """A failure was recorded (`failure.kind`: a rank's exception, process death, node
        loss, hang, preemption, or the driver's crash or interrupt; `failure.charged` if it
        counts toward max_failures). `failures_left`: how many more charged failures the run
        survives (None: unlimited); 0 with `failure.charged` means the run ends with it.
        A driver's crash is told by the next driver that trains the run, when it starts."""

    def after_run_end(self, run_context: TrainRunContext, status: str, error: str | None) -> None:
        """The driver is done with the run: `status` is "finished", "failed" (`error` says
        why) or "interrupted" (the driver was stopped; a rerun by name resumes). Not called
        when the driver is killed."""


def numbers(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers among a report's `metrics`, nested dicts flattened as "a/b" (what a tracker
    can plot); strings, bools and the rest left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def describe(item: Any) -> str:
    """How `item` of RunConfig.callbacks is shown where Prefect stores the parameters: an
    instance by its class's import path (its attributes may hold credentials)."""
    if isinstance(item, UserCallback):
        return f"{type(item).__module__}:{type(item).__qualname__}"
    return item


def check_form(item: Any, where: str) -> Any:
    """`item` of RunConfig.callbacks if its form is one of the three (credentials in kwargs
    held hidden: `ft_train.storage.credentials`); ValueError naming `where` and the fix."""
    if isinstance(item, UserCallback):
        return item
    if isinstance(item, str):
        _split(item, where)
        return item
    if isinstance(item, dict):
        unknown = sorted(set(item) - {"callback", "kwargs"})
        if unknown or not isinstance(item.get("callback"), str):
            raise ValueError(
                f"{where}: a dict item is {{'callback': 'pkg.mod:Callback', 'kwargs': {{...}}}}"
                + (f"; {', '.join(map(repr, unknown))} is not one of its keys" if unknown else "")
            )
        _split(item["callback"], f"{where}.callback")
        kwargs = item.get("kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"{where}.kwargs: give a dict of keyword arguments")
        return {"callback": item["callback"], "kwargs": hide(kwargs)}
    raise ValueError(
        f"{where}: a {type(item).__name__} is not a callback; give an import path "
        "'pkg.mod:Callback', {'callback': 'pkg.mod:Callback', 'kwargs': {...}}, or an "
        "instance of a subclass of ft_train.UserCallback"
    )


def hide(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with their credentials held as pydantic Secrets, which every JSON encoding
    (Prefect's included) and repr show masked: those whose name says so (token, password, ...),
    and a URL holding a password (http://user:password@host)."""
    hidden = credentials.hide(kwargs)
    return {
        k: credentials.hide({"password": v})["password"]
        if isinstance(v, str) and URL_PASSWORD.search(v)
        else v
        for k, v in hidden.items()
    }


def load_all(run_config: Any) -> list[UserCallback]:
    """The callbacks of `run_config`, imported and built in the driver. ConfigError naming the
    item and the fix if a path does not import, names no UserCallback, or its class refuses
    the kwargs."""
    return [load(item, f"run_config.callbacks[{i}]") for i, item in enumerate(run_config.callbacks)]


def load(item: Any, where: str) -> UserCallback:
    """The callback `item` stands for (see `load_all`)."""
    if isinstance(item, UserCallback):
        return item
    path, kwargs = (item, {}) if isinstance(item, str) else (item["callback"], item["kwargs"])
    module_name, attr = _split(path, where)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(
            f"{where} {path!r}: module {module_name!r} does not import ({type(e).__name__}: "
            f"{e}); install it where the flow runs, or fix the path ('pkg.mod:Callback')"
        ) from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
    if isinstance(target, type) and issubclass(target, UserCallback):
        try:
            return target(**credentials.reveal(kwargs))
        except Exception as e:
            raise ConfigError(
                f"{where} {path!r}: {target.__name__}(**kwargs) raised {type(e).__name__}: "
                f"{e}; fix the kwargs given with it"
            ) from None
    if isinstance(target, UserCallback) and not kwargs:
        return target
    what = "nothing" if target is None else f"a {type(target).__name__}"
    raise ConfigError(
        f"{where} {path!r}: names {what}, not a subclass of ft_train.UserCallback"
        + (" (kwargs are given: name a class)" if kwargs and target is not None else "")
        + "; subclass ft_train.UserCallback, or fix the path"
    )


def _split(path: str, where: str) -> tuple[str, str]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{where} {path!r}: give an import path 'pkg.mod:Callback' (a module, a colon, a "
            "class in it)"
        )
    return module_name, attr
