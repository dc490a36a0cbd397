"""Deployment definitions and helpers; `prefect.yaml` at the repository root defines the
deployments, and `demo.py` holds the demo's parameters, which `ft-train demo` and the tests read."""
