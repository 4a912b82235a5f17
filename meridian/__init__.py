"""Meridian: open, distributed reinforcement learning for LLM coding agents.

This package holds the plumbing every service shares (configuration, gRPC bootstrap,
telemetry, Redis streams, the CLI); each service's own code lives under ``services/``.
"""
