"""Log messages recorded during a block: pytest runs with ``-p no:logging`` (no caplog)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class Records(logging.Handler):
    """Messages of WARNING and above, as logged (``record.getMessage()``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def recorded(logger: str) -> Iterator[Records]:
    """The messages ``logger`` (and its children) log inside the ``with`` block."""
    records, log = Records(), logging.getLogger(logger)
    log.addHandler(records)
    try:
        yield records
    finally:
        log.removeHandler(records)
