"""An actor's process that Ray ends with SIGTERM leaves at once and quietly.

Ray ends an actor's process with SIGTERM (SIGKILL a while later), and its handler raises
`SystemExit` wherever the main thread happens to be. Mostly that is Ray's task loop and the
process exits cleanly. But when the signal lands while the main thread runs a weakref callback
or a `__del__` (a garbage collection: a thread pool freed, say), Python cannot raise there: it
prints "Exception ignored in ..." with a traceback into the log the driver streams (`manta
serve`'s own log) and carries on, so the process lives on until Ray's SIGKILL. This module's
hook turns that swallowed `SystemExit` into the exit it asked for."""

from __future__ import annotations

import os
import sys

_INSTALLED = "_manta_exit_on_swallowed_system_exit"


def install() -> bool:
    """In a Ray actor's process (else nothing; returns whether it is installed): from here on, a
    `SystemExit` that Python would swallow (and print) exits the process with that code instead.
    Idempotent; other unraisable exceptions go to the previous hook. It holds for the whole
    process (a finalizer on any thread), which is no worse than the SIGKILL Ray sends next. The
    classes that call it also run in-process (tests, `mp_group`'s ranks), where nothing changes."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    previous = sys.unraisablehook
    if getattr(previous, _INSTALLED, False):
        return True

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            code = unraisable.exc_value.code
            os._exit(0 if code is None else code if isinstance(code, int) else 1)
        previous(unraisable)

    setattr(hook, _INSTALLED, True)
    sys.unraisablehook = hook
    return True
