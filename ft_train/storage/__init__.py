"""Storage and what is stored: the fsspec wrapper, checkpoints, the run state and the
checkpoint manager that commits to it."""
