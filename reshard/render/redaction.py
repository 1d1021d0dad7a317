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

__all__ = ["redact"]

#: Environment variables whose values are secrets wherever they appear in text.
_SECRET_ENV = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY|ACCOUNT_KEY|SAS_", re.IGNORECASE)
#: ... unless the variable names a place rather than holding the secret (``AWS_SHARED_CREDENTIALS_FILE``).
_PLACE_ENV = re.compile(r"_(FILE|PATH|DIR|URL|ENDPOINT)$", re.IGNORECASE)
_USERINFO = re.compile(r"(://)/*[^/@\s]*@")                     # s3://user@, s3:///KEY:SECRET@
_PAIR = re.compile(r"[^\s/@:'\"=]+:[^\s/@'\"]+@")                 # KEY:SECRET@ anywhere in a URL
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|AIPA)[A-Z0-9]{12,}\b")
_SIGNED = re.compile(r"(?i)\b(X-Amz-(?:Credential|Signature|Security-Token)|sig|signature)=[^&\s'\"]+")
_REDACTED = "<redacted>"


def redact(text: str) -> str:
    """``text`` with anything that looks like a credential replaced by ``<redacted>``: the userinfo
    of a URL (``://user:secret@``), AWS access key ids, presigned-URL and SAS parameters, and the
    literal value of any environment variable named like a secret (``AWS_SECRET_ACCESS_KEY``,
    ``*_TOKEN``, ``*_PASSWORD``; values of eight characters or more). Applied to every message,
    report and JSON object reshard prints or writes."""
    if not text:
        return text
    out = _USERINFO.sub(r"\1" + _REDACTED + "@", text)
    out = _PAIR.sub(_REDACTED + "@", out)
    out = _AWS_KEY_ID.sub(_REDACTED, out)
    out = _SIGNED.sub(lambda m: f"{m.group(1)}={_REDACTED}", out)
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_ENV.search(name) and not _PLACE_ENV.search(name) and value in out:
            out = out.replace(value, _REDACTED)
    return out
