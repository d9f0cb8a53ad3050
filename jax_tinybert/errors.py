"""User mistakes vs bugs.

A `UserError` is a mistake in the command line, a config value, a path or the data: its
message names the problem and the fix ("<problem>; <fix>"). The command line prints it as one
line `error: <problem>; <fix>` and exits with status 2 (a traceback only with --verbose);
any other exception is a bug in this program and keeps its traceback.

Subclasses keep the builtin base they always had (ValueError, FileNotFoundError), so library
code that catches those still works.
"""
from __future__ import annotations

import errno
import sys
from typing import Callable, Optional

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake the user can fix; the message says what is wrong and how to fix it."""


class PathError(UserError, FileNotFoundError):
    """A path in the config or on the command line that does not exist or cannot be read."""


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` or an exception it was raised from is ENOSPC (orbax and TensorStore report it
    as a ValueError 'RESOURCE_EXHAUSTED: ... No space left on device')."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def one_line(e: BaseException) -> str:
    """The message of `e` on one line (multi-line messages are joined with '; ')."""
    msg = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    parts = [p.strip() for p in msg.splitlines() if p.strip()]
    return "; ".join(parts) if parts else type(e).__name__


def tool_exit(main: Callable[[], Optional[int]]) -> int:
    """The exit status of a `python -m jax_tinybert.<tool>` entry point: main()'s (0 for None);
    a UserError it raises is printed as one line `error: ...` on stderr, status 2, as the
    training command line does. Anything else keeps its traceback."""
    try:
        return main() or 0
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR


__all__ = ["UserError", "PathError", "EXIT_USER_ERROR", "one_line", "is_disk_full", "tool_exit"]
