"""Credentials inside URIs, hidden wherever shoal writes or shows text.

A URI may carry a secret two ways: user info (`https://user:password@host`,
`s3://KEY:SECRET@bucket`, `https://TOKEN@host`) and query parameters (`?token=...`,
pre-signed `X-Amz-Signature=...&X-Amz-Credential=...`). `redact` replaces them with
`***` in any text (a URI, an error message, a log line, a whole YAML document), so that
MLflow params, tags, artifacts, events, logs, Ray job metadata and the terminal never hold
one. `without_credentials` drops them from a URI handed on to another process, which
finds its credentials where they belong: in its environment or the usual credentials files.
No third-party imports: workers import this too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

MASK = "***"

# scheme://userinfo@ : everything between `//` and the last `@` before the host's end
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#@\s'\"]+)@")

# query or fragment parameters whose names say they hold a secret
_SECRET_NAME = (
    r"[A-Za-z0-9_.-]*(?:token|secret|passw(?:or)?d|pwd|signature|sig|credential|api[_-]?key|"
    r"access[_-]?key|auth|session|key)[A-Za-z0-9_.-]*"
)
_QUERY_SECRET = re.compile(rf"(?P<lead>[?&;#](?i:{_SECRET_NAME})=)(?P<value>[^&#\s'\"]*)")


def _mask_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match.group("userinfo").partition(":")
    shown = f"{user}:{MASK}" if colon else MASK  # a lone user info part is a token
    return f"{match.group('scheme')}{shown}@"


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it replaced by ***."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(_mask_userinfo, text)
    return _QUERY_SECRET.sub(lambda m: f"{m.group('lead')}{MASK}" if m.group("value") else m.group(0), text)


def _each_string(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of nested dicts / lists / tuples with `change` applied to every string."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {key: _each_string(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_each_string(item, change) for item in value)
    return value


def redact_data(value: Any) -> Any:
    """A copy of nested dicts / lists / tuples with every string redacted."""
    return _each_string(value, redact)


def without_credentials(uri: str) -> str:
    """`uri` with its user info and secret query parameters removed (not masked): what a
    URI handed to another process carries."""
    uri = _USERINFO.sub(lambda m: m.group("scheme"), uri)
    uri = _QUERY_SECRET.sub("", uri)
    if "?" not in uri and "&" in uri:  # the first parameter went: the next one starts the query
        uri = uri.replace("&", "?", 1)
    return uri


def without_credentials_data(value: Any) -> Any:
    """A copy of nested dicts / lists / tuples whose URI strings carry no credentials."""
    return _each_string(value, lambda text: without_credentials(text) if has_credentials(text) else text)


def has_credentials(text: str) -> bool:
    return redact(text) != text


class RedactingFilter(logging.Filter):
    """Log records with the credentials of their URIs masked (message and traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args = redact(message), None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def redact_logs(*targets: logging.Logger | logging.Handler) -> None:
    """Mask credentials in what these loggers (records logged on them) and handlers (every
    record they write) emit; calling it again adds nothing."""
    for target in targets:
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())
