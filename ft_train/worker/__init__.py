"""What runs inside a Dask worker: the session a training function calls, the rank
process around it, its journal, the agreement, the preemption watcher, uploads and staging."""
