"""What megafp8 tells its user about a mistake or a caveat (the base layer: imports nothing of megafp8).

- `check_integer`: a size given by a user, checked with an error that names it and its value.
- `show_warnings_as_messages`: the command-line programs (the trainer, tools/*.py) print their
  warnings as `<program>: warning: <text>`, not as Python's `path/file.py:123: UserWarning: text`
  followed by the source line, which reads like a crash to someone running a tool:

      from megafp8.messages import show_warnings_as_messages
      show_warnings_as_messages("preprocess_data")   # first thing in main()
"""

from __future__ import annotations

import warnings


def check_integer(name: str, value, minimum: int = 1, note: str = "") -> int:
    """`value` if it is an int >= `minimum`, else ValueError naming `name` (and `note` after the
    value). bool is an int subclass, but True as a size is a mistake, not 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}{note}")
    return value


def show_warnings_as_messages(program: str) -> None:
    """Print every warning from now on as one line, `<program>: warning: <text>`."""

    def format_warning(message, category, filename, lineno, line=None):
        return f"{program}: warning: {message}\n"

    warnings.formatwarning = format_warning
