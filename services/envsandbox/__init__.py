"""The envsandbox service."""
