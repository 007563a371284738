"""Frontends: ways to reach a running Engine (the OpenAI-compatible HTTP server, its CLI)."""
