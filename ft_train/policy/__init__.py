"""Decisions the controller executes, in pure functions: what a failure is charged to
(`attribution`), whether the run retries or ends (`failure`), whether an elastic group grows
(`elastic`)."""
