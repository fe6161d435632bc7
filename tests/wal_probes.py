"""Probes into the WAL's loop driver shared by the WAL and engine tests."""
from __future__ import annotations

from typing import Any


def flag_completions(driver: Any) -> list[bool]:
    """Wrap ``driver._finish`` (the call that completes the loop's AIO writes) so a test can
    tell whether its code ran inside it: the returned one-item list holds True while it runs."""
    completing = [False]
    real_finish = driver._finish

    def finish(events: Any) -> Any:
        completing[0] = True
        try:
            return real_finish(events)
        finally:
            completing[0] = False

    driver._finish = finish
    return completing
