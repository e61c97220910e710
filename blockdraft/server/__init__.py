"""OpenAI-compatible HTTP server (`blockdraft serve`); needs the `server` extra."""

from blockdraft.server.app import build_app, run_server

__all__ = ["build_app", "run_server"]
