"""`ft_train.collective`: Ray Train's `ray.train.collective`, `barrier()` and
`broadcast_from_rank_zero(data)`, with Ray's meaning, for use inside a training function.

Both run over the rank's control group, the small gloo group that also carries report()'s
agreement, as agreement points of their own (`ft_train.worker.session.Session.sync_point`):
the agreement still pending is read first, then the collective's own runs, so the group never
carries two operations at once and every rank issues them in the same order. Every rank must
call them at the same place of its sequence of report(), get_preemption_info() and these calls;
a rank that does not fails with a SessionError, on every rank, instead of pairing its
operations with another kind. Like report(), they also deliver what the group agreed on: a
preemption notice, or the driver's request to stop.

Unlike Ray, broadcast_from_rank_zero() takes data of any size (Ray refuses more than 1 kB):
rank 0's object is pickled and sent as bytes.
"""

from __future__ import annotations

import pickle
from typing import TypeVar

from .errors import SessionError
from .protocol import Point
from .worker.session import current_session

__all__ = ["barrier", "broadcast_from_rank_zero"]

T = TypeVar("T")


def barrier() -> None:
    """Returns once every rank has called it."""
    current_session().sync_point(Point.BARRIER)


def broadcast_from_rank_zero(data: T) -> T:
    """Rank 0's `data` on every rank (each other rank's own argument is ignored; pass None).
    A barrier too: returns once every rank has called it. Rank 0 gets its own object back, the
    others a copy (it must pickle: where it does not, rank 0 raises the pickling error and the
    others a SessionError)."""
    session = current_session()
    rank = session.spec.rank
    payload, error = b"", None
    if rank == 0:
        try:
            payload = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # still take part in the agreement: the others must not wait
            error = e
    size = len(payload) + 1 if rank == 0 and error is None else 0
    agreed = session.sync_point(Point.BROADCAST, size)
    if error is not None:
        raise error
    if agreed.payload == 0:
        raise SessionError(
            "ft_train.collective.broadcast_from_rank_zero(): rank 0's data could not be "
            "pickled (its error is in rank 0's failure); broadcast plain data"
        )
    if session.control is None or session.spec.world_size == 1:
        return data
    return _broadcast(session.control, rank, payload, agreed.payload - 1, data)


def _broadcast(control, rank: int, payload: bytes, size: int, data: T) -> T:
    import torch
    import torch.distributed as dist

    if rank == 0:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    control.broadcast([buffer], options).wait()
    return data if rank == 0 else pickle.loads(buffer.numpy().tobytes())
