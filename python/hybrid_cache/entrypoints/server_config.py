"""The server's defaults, in one place (no imports: `hybrid-cache serve --help` stays light)."""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Largest request body accepted (bytes; larger: HTTP 413).
DEFAULT_MAX_REQUEST_BYTES = 1024**2
# Requests queued, running or not yet read to the end before new ones get HTTP 503.
DEFAULT_MAX_PENDING_REQUESTS = 1024
# Tokens a stream gathers before it sends them (the first token always goes at once).
DEFAULT_STREAM_INTERVAL = 1
# The engine runs in a process of its own (`--no-engine-process`: on a thread of the server's).
DEFAULT_ENGINE_PROCESS = True
# Where `--api-key` is read from when not given.
API_KEY_VARIABLE = "HYBRID_CACHE_API_KEY"
