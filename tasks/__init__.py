"""Thin Prefect tasks over the ft_train library. They run in the flow process."""

from .train import finalize, prepare_run, provision_workers, train_segment

__all__ = ["prepare_run", "provision_workers", "train_segment", "finalize"]
