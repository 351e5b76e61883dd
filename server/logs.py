"""Logging of `fairtick serve`: one handler on stderr, configured once at start-up.

fairtick's loggers (`fairtick.server`, `fairtick.engine`, `fairtick.requests`: one line per
request that ends) and Sanic's (`sanic.*`: worker start and stop, errors) all propagate to the
root logger and share its level and format. Sanic's access log (`--access-log`) writes its
fields as record extras with an empty message; a filter spells them into the message, so an
access line reads like every other line. `transitions` logs every trigger at INFO: it is kept
at WARNING unless the level is DEBUG.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

LOG_LEVEL_ENV = "FAIRTICK_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "sanic.access"


def check_log_level(level: str) -> str:
    """`level` in lower case; ValueError naming the allowed levels."""
    if not isinstance(level, str) or level.lower() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (--log-level, "
                         f"{LOG_LEVEL_ENV}), got {level!r}")
    return level.lower()


def configure_logging(level: str, stream: TextIO | None = None) -> None:
    """Send every logger's records at `level` or above to `stream` (default stderr)."""
    handler = _ServeHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _ServeHandler)]:
        root.removeHandler(old)  # configured again in this process (tests): one handler still
    root.addHandler(handler)
    root.setLevel(check_log_level(level).upper())
    logging.getLogger("transitions").setLevel(
        logging.DEBUG if level.lower() == "debug" else logging.WARNING)
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, AccessLine) for f in access.filters):
        access.addFilter(AccessLine())


class _ServeHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure_logging` installs (told apart from any other)."""


class AccessLine(logging.Filter):
    """Writes Sanic's access record extras into its message:
    `127.0.0.1:51234 "POST http://host/v1/completions" 200 chunked 3.2ms`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.msg and hasattr(record, "request"):
            fields = record.__dict__
            record.msg = (f'{fields.get("host", "-")} "{fields["request"]}" '
                          f'{fields.get("status", "-")} {fields.get("byte", "-")}'
                          f'{fields.get("duration", "")}')
            record.args = ()
        return True
