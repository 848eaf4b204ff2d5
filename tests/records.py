"""A logging handler that keeps messages: pytest runs with ``-p no:logging`` (no caplog)."""

from __future__ import annotations

import logging


class Records(logging.Handler):
    """Messages of WARNING and above, as logged (``record.getMessage()``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
