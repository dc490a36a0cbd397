"""Test support that stays off the training path: fault injection."""
