"""An engine closed before the interpreter exits, for a caller that never closes it.

At exit Python runs its atexit handlers (JAX's own `clean_up` among them: it drops the backends and caches), then
finalizes; a daemon thread still inside XLA then (a background compile or cache load, a step) is ended by a forced
unwind through C++ frames when it next takes the GIL, and the process aborts ("FATAL: exception not rethrown", exit
134: `bench/exit_abort.py`). An engine registers its `close` here after JAX has started, so it runs before JAX's
handlers (atexit calls the last registered first) and joins the engine's threads. Held weakly: an engine collected
before exit leaves nothing behind.
"""
from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable


def close_at_exit(close: Callable[[], None]) -> Callable[[], None]:
    """Call the bound method `close` at interpreter exit if its object is still alive then. Returns the function
    that cancels this (`close` itself calls it: a closed engine is not closed again at exit)."""
    ref = weakref.WeakMethod(close)

    def at_exit() -> None:
        method = ref()
        if method is not None:
            method()

    atexit.register(at_exit)
    return lambda: atexit.unregister(at_exit)
