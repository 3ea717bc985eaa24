"""What the command-line programs (the trainer, tools/*.py) show a user besides their output.

    from megafp8.console import show_warnings_as_messages
    show_warnings_as_messages("preprocess_data")   # first thing in main()

Python prints a warning as `path/file.py:123: UserWarning: text` followed by the source line
that raised it, which reads like a crash to someone running a tool. A program's own warnings
are messages to its user: `preprocess_data: warning: text`.
"""
from __future__ import annotations

import warnings


def show_warnings_as_messages(program: str) -> None:
    """Print every warning from now on as one line, `<program>: warning: <text>`."""

    def format_warning(message, category, filename, lineno, line=None):
        return f"{program}: warning: {message}\n"

    warnings.formatwarning = format_warning
