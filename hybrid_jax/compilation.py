"""Counting XLA compilations, and JAX's persistent compilation cache as the CLI sets it up.

    with CompileCounter() as cc:
        logits = step(...)
    cc.compiled, cc.cache_hits   # backend compilations done here / executables loaded from the persistent cache

JAX reports every executable it builds through `jax.monitoring` (a cache hit too, as a compile event plus a
cache-hit event), so `compiled` = compile events − persistent-cache hits. Listeners are registered once per
process; counters are differences of process-wide totals, so nested and repeated uses are fine.
"""

from __future__ import annotations

import collections
import threading

import jax

_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
_totals: collections.Counter = collections.Counter()
_lock = threading.Lock()
_installed = False


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return

        def on_event(name, **_):
            if name == _HIT:
                _totals[_HIT] += 1

        def on_duration(name, _secs, **_):
            if name == _COMPILE:
                _totals[_COMPILE] += 1

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        _installed = True


class CompileCounter:
    """Context manager: XLA compilations (`compiled`) and persistent-cache loads (`cache_hits`) inside it."""

    def __init__(self):
        _install()
        self._start = collections.Counter()
        self._end: collections.Counter | None = None

    def __enter__(self) -> CompileCounter:
        self._start = collections.Counter(_totals)
        self._end = None
        return self

    def __exit__(self, *exc) -> None:
        self._end = collections.Counter(_totals)

    def _delta(self, key: str) -> int:
        end = _totals if self._end is None else self._end
        return end[key] - self._start[key]

    @property
    def cache_hits(self) -> int:
        return self._delta(_HIT)

    @property
    def compiled(self) -> int:
        return self._delta(_COMPILE) - self.cache_hits


def enable_persistent_cache(path: str) -> None:
    """Cache every executable in `path` (no minimum compile time or size), so that a second process with
    the same code, shapes and devices compiles nothing."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
