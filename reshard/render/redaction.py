"""Credentials redacted from every line reshard prints and every report it writes.

Why a module of its own, in render: the first defence is that nothing in reshard reads, prints
or records a credential (they come from the store's own chain, and `reshard.storage.objectstore.urls.parse`
refuses a URL with an ``@`` anywhere before anything can echo it). This is the last one: text on
its way to a person or a file passes `redact`, so a secret that reached a message by a path no
one foresaw (a store's error quoting a presigned URL, an environment variable's value in a
path) is replaced by ``<redacted>`` (issue 42).
"""
from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["redact"]

#: Environment variables whose values are secrets wherever they appear in text.
_SECRET_ENV = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY|ACCOUNT_KEY|SAS_", re.IGNORECASE)
#: ... unless the variable names a place rather than holding the secret (``AWS_SHARED_CREDENTIALS_FILE``).
_PLACE_ENV = re.compile(r"_(FILE|PATH|DIR|URL|ENDPOINT)$", re.IGNORECASE)
_USERINFO = re.compile(r"(://)/*[^/@\s]*@")                     # s3://user@, s3:///KEY:SECRET@
_PAIR = re.compile(r"[^\s/@:'\"=]+:[^\s/@'\"]+@")                 # KEY:SECRET@ anywhere in a URL
_AWS_PREFIXES = ("AKIA", "ASIA", "AIDA", "AROA", "AGPA", "ANPA", "ANVA", "AIPA")
_AWS_KEY_ID = re.compile(r"\b(?:" + "|".join(_AWS_PREFIXES) + r")[A-Z0-9]{12,}\b")
_SIGNED = re.compile(r"(?i)\b(X-Amz-(?:Credential|Signature|Security-Token)|sig|signature)=[^&\s'\"]+")
_REDACTED = "<redacted>"


def redact(text: str) -> str:
    """``text`` with anything that looks like a credential replaced by ``<redacted>``: the userinfo
    of a URL (``://user:secret@``), AWS access key ids, presigned-URL and SAS parameters, and the
    literal value of any environment variable named like a secret (``AWS_SECRET_ACCESS_KEY``,
    ``*_TOKEN``, ``*_PASSWORD``; values of eight characters or more). Applied to every message,
    report and JSON object reshard prints or writes.

    Each pattern runs only on the lines that hold its literal anchor (`_ANCHORED`): a plan's JSON
    at 180k keys is 18 MB with one anchor (the ``=`` of ``dp=4``), and the regexes over all of it took
    2.4 s of CPU where the anchors' scans (``str.find``) and that one line take 0.1 s. The result is the same as
    the patterns over the whole text: no match spans a newline, and a line's start and end are
    word boundaries as the text's are (`_on_anchored_lines`)."""
    if not text:
        return text
    out = text
    for pattern, repl, anchors in _ANCHORED:
        out = _on_anchored_lines(out, pattern, repl, anchors)
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_ENV.search(name) and not _PLACE_ENV.search(name) and value in out:
            out = out.replace(value, _REDACTED)
    return out


#: (pattern, replacement, literals of which every match holds one), in the order they apply.
_ANCHORED: tuple[tuple[re.Pattern[str], Any, tuple[str, ...]], ...] = (
    (_USERINFO, r"\1" + _REDACTED + "@", ("@",)),
    (_PAIR, _REDACTED + "@", ("@",)),
    (_AWS_KEY_ID, _REDACTED, _AWS_PREFIXES),
    (_SIGNED, lambda m: f"{m.group(1)}={_REDACTED}", ("=",)),
)


def _on_anchored_lines(text: str, pattern: re.Pattern[str], repl: Any, anchors: tuple[str, ...]) -> str:
    """``pattern.sub(repl, text)``, run only on the lines that hold one of ``anchors``.

    Why equal to the whole-text ``sub``: every match holds an anchor and no newline (each
    pattern's classes exclude ``\\s``), so matches lie within anchored lines; a line cut at
    ``\\n`` starts and ends where ``\\b`` sees a non-word neighbour, as in the whole text."""
    starts = sorted({i for a in anchors for i in _positions(text, a)})
    changed: list[tuple[int, int, str]] = []  # (start, end, redacted line) of each line the pattern changed
    done = 0  # lines before here are done
    for i in starts:
        if i < done:
            continue  # on a line already done
        lo = text.rfind("\n", done, i) + 1 or done
        hi = text.find("\n", i)
        hi = len(text) if hi < 0 else hi
        line = text[lo:hi]
        new = pattern.sub(repl, line)
        if new != line:
            changed.append((lo, hi, new))
        done = hi
    if not changed:
        return text  # the text itself: no copy of an 18 MB report for an anchor that redacted nothing
    parts: list[str] = []
    done = 0
    for lo, hi, new in changed:
        parts += [text[done:lo], new]
        done = hi
    parts.append(text[done:])
    return "".join(parts)


def _positions(text: str, literal: str) -> list[int]:
    """Where ``literal`` occurs in ``text`` (``str.find``: a scan of memory, not a regex)."""
    out: list[int] = []
    i = text.find(literal)
    while i >= 0:
        out.append(i)
        i = text.find(literal, i + 1)
    return out
