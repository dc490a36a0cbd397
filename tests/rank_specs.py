"""One way for tests to stand as a rank without a cluster: a `RankSpec` with every field a test
does not care about filled in, and a `Session` installed for the duration of a block (as
`ft_train.worker.rank` installs one around the training function)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ft_train.protocol import Message, RankSpec
from ft_train.storage.fs import Storage
from ft_train.worker import session
from ft_train.worker.session import Session


def rank_spec(storage: Storage, rank: int = 0, world_size: int = 1, **fields: Any) -> RankSpec:
    """A rank's spec on `storage`, for a run named "run" at attempt 0; `fields` override any."""
    defaults: dict[str, Any] = dict(
        train_loop="unused:fn",
        config={},
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
        name="run",
        attempt=0,
        attempt_id="0" * 32,
        master_addr="127.0.0.1",
        master_port=0,
        backend="gloo",
        use_gpu=False,
        storage=storage,
        checkpoint_dir=None,
        start_report_index=0,
        topic="unused",
        collective_timeout_s=60.0,
        agreement_interval_s=0.0,
    )
    return RankSpec(**{**defaults, **fields})


@contextlib.contextmanager
def installed(
    spec: RankSpec, send: Callable[[Message], None] = lambda message: None
) -> Iterator[Session]:
    """Code inside runs as the rank `spec` describes, as inside a training function."""
    current = Session(spec, send)
    session.install(current)
    try:
        yield current
    finally:
        session.install(None)
