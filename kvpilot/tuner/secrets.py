"""Masking every password a database URL or a libpq connection string can carry, before it is shown.

A PostgreSQL password reaches a storage URL in more forms than `user:password@`:

* in the userinfo, unescaped characters that are not allowed there (`/`, `@`, `?`) or %-escapes;
  SQLAlchemy and libpq disagree on where such a password ends (`postgresql://u:p/ss@h/db` is the
  password `p/ss` to SQLAlchemy, the port `p` and the database `ss@h/db` to libpq), so everything
  either might read as the password is masked: from the username's `:` to the last `@` before
  the query;
* as a query parameter, `?password=...` or `?sslpassword=...`, alone or among libpq's other
  connection parameters (`?host=h&user=u&password=...`), its key %-escaped or not;
* in a libpq keyword/value string, `host=h user=u password=secret` (the value quoted with
  `'...'` and backslash escapes, or bare up to the next space), also inside a query parameter.

Masking errs towards hiding: a value it cannot be sure of is masked.  Afterwards, the password as
SQLAlchemy and (where psycopg is installed) libpq themselves read it must be gone from the text;
where one still shows (as a whole token), it is masked wherever it appears.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

MASK = "***"
# libpq's secret connection parameters, and the names MySQL's drivers take a password under.
SECRET_KEYS = frozenset({"password", "sslpassword", "passwd", "pwd"})

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S*")
# libpq's keyword = value: a quoted value runs to its closing quote (backslash escapes inside), a
# bare one to the next white space (a backslash escapes there too).
_KEYWORD_VALUE = re.compile(
    r"(?<![\w.%\-])(?P<key>[A-Za-z_]\w*)(?P<eq>\s*=\s*)(?P<value>'(?:\\.|[^'\\])*'?|(?:\\.|[^\s\\])*\\?)")


def redacted(text: str) -> str:
    """`text` (a storage URL, a libpq string, or a message holding either) with every password as ***."""
    if _SCHEME.match(text):
        return _parsers_agree(text, _url(text))
    out: list[str] = []
    last = 0
    for m in _URL_IN_TEXT.finditer(text):
        out.append(_keyword_values(text[last:m.start()]))
        out.append(_url(m.group()))
        last = m.end()
    out.append(_keyword_values(text[last:]))
    return _parsers_agree(text, "".join(out))


def has_password(text: str) -> bool:
    """Whether `text` carries a password in any of the forms `redacted` masks."""
    return redacted(text) != text


def _url(url: str) -> str:
    start = _SCHEME.match(url)
    assert start is not None
    head, rest = url[: start.end()], url[start.end():]
    first_at = rest.find("@")
    if first_at >= 0:
        query = rest.find("?", first_at)
        at = rest.rfind("@", 0, query if query >= 0 else len(rest))
        user, colon, _ = rest[:at].partition(":")
        # SQLAlchemy's username holds no '/': without one this is userinfo, not a path holding '@'.
        if colon and "/" not in user:
            rest = f"{user}:{MASK}{rest[at:]}"
    path, qmark, query_text = rest.partition("?")
    if qmark:
        query_text = "&".join(_parameter(p) for p in query_text.split("&"))
    return head + path + qmark + query_text


def _parameter(pair: str) -> str:
    key, eq, value = pair.partition("=")
    if not eq:
        return pair
    if unquote(key).strip().lower() in SECRET_KEYS:
        return f"{key}={MASK}"
    decoded = unquote_plus(value)
    if _keyword_values(decoded) != decoded:  # a libpq string (a dsn) carried in a parameter
        return f"{key}={MASK}"
    return pair


def _keyword_values(text: str) -> str:
    def mask(m: re.Match[str]) -> str:
        if m.group("key").lower() in SECRET_KEYS:
            return m.group("key") + m.group("eq") + MASK
        return m.group(0)

    return _KEYWORD_VALUE.sub(mask, text)


def _parsers_agree(original: str, masked: str) -> str:
    """`masked`, with any password SQLAlchemy or libpq reads from `original` that it still shows masked too."""
    for secret in _parsed_passwords(original):
        if secret and secret != MASK:
            # As a whole token: a one-letter password is not the same letter inside "postgresql".
            masked = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", MASK, masked)
    return masked


def _parsed_passwords(text: str) -> list[str]:
    found: list[str] = []
    try:
        from sqlalchemy.engine import make_url

        url = make_url(text)
        found.append(url.password or "")
        for key, value in url.query.items():
            if key.lower() in SECRET_KEYS:
                found += [value] if isinstance(value, str) else list(value)
    except Exception:  # not a URL SQLAlchemy reads: it has nothing to connect with either
        pass
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:  # kvpilot[postgresql] not installed: libpq reads nothing here
        return found
    try:
        params = conninfo_to_dict(text)
    except Exception:  # not a string libpq reads
        return found
    found += [str(params[k]) for k in ("password", "sslpassword") if params.get(k)]
    return found
