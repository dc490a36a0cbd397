"""What runs in the flow process: prepare a run (validate, rehydrate, resume), hold its
lease, and start worker groups on a Dask cluster."""
