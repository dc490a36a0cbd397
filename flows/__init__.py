"""Prefect flows: sequencing only."""
