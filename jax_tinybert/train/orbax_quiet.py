"""orbax's own reports of a failed save, quieted: the save raises one line (checkpoints.py's
DiskFull) while orbax's threads print pages of tracebacks for the same failure. --verbose (the
package's logger at DEBUG) keeps them."""
from __future__ import annotations

import logging
import os
import sys

from jax_tinybert.errors import is_disk_full

log = logging.getLogger(__name__)


class _OrbaxDiskFullReports(logging.Filter):
    """Drops orbax's own ERROR reports of a full disk: each of its save threads logs the ENOSPC
    with a traceback (~320 lines for one failed save), and the save then raises DiskFull, one
    line. Kept with --verbose (this package's logger at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname
                or log.isEnabledFor(logging.DEBUG)):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and is_disk_full(exc))
                    or "No space left on device" in record.getMessage())


_ORBAX_DISK_FULL_REPORTS = _OrbaxDiskFullReports()
_previous_unraisablehook = None


def _quiet_closed_loop(unraisable) -> None:
    """sys.unraisablehook that drops TensorStore's 'Event loop is closed' (a write callback
    arriving after orbax closed the loop of a save that failed, printed as a bare traceback from
    C++), unless --verbose; everything else goes to the hook it replaced."""
    if not (isinstance(unraisable.exc_value, RuntimeError) and unraisable.object is None
            and str(unraisable.exc_value) == "Event loop is closed"
            and not log.isEnabledFor(logging.DEBUG)):
        (_previous_unraisablehook or sys.__unraisablehook__)(unraisable)


def quiet_orbax_failures() -> None:
    """Installs the two filters above, once per process."""
    global _previous_unraisablehook
    logging.getLogger("absl").addFilter(_ORBAX_DISK_FULL_REPORTS)   # a set: added once
    if sys.unraisablehook is not _quiet_closed_loop:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _quiet_closed_loop
