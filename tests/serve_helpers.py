"""A ``rolling-forcing serve`` process on a free loopback port, for the process and browser tests: the
bench's own launcher (:func:`perf.serve_switch.running_server`), so tests and bench start it alike."""

from __future__ import annotations

from perf.serve_switch import running_server

__all__ = ["running_server"]
