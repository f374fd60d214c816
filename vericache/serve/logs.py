"""Server logs: plain text for a person at a terminal, or one JSON object per line for a log
pipeline (`vericache serve --log-format json`). Request events carry their request id and what a
reader filters on as fields (`extra=`), not only inside the message."""

from __future__ import annotations

import json
import logging
import sys
import time

# Every attribute of a LogRecord that logging itself sets: anything else came through `extra=`.
_STANDARD_ATTRIBUTES = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", **extra fields, "exception"?} on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD_ATTRIBUTES and not name.startswith("_"):
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...`, the extra fields after the message."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = [
            f"{name}={value}"
            for name, value in vars(record).items()
            if name not in _STANDARD_ATTRIBUTES and not name.startswith("_")
        ]
        return " ".join([super().format(record), *fields])


def configure_logging(log_format: str = "text", level: int = logging.INFO, stream=None) -> None:
    """Sends the server's logs (the `vericache` loggers) to `stream` (stderr) in `log_format`."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logger = logging.getLogger("vericache")
    logger.handlers = [handler]
    logger.setLevel(level)
    logger.propagate = False
