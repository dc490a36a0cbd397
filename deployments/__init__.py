"""Deployment helpers; `prefect.yaml` at the repository root defines the deployments."""
