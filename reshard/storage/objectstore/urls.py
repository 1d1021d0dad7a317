"""Object-store URLs: the one parser every command, reader and writer uses, and redaction.

Why one module: a URL reaches reshard as a source, a destination, a ``verify`` side, a
profile's value; each place used to test ``scheme://`` with its own regular expression, and
each test was a way around the others (``s3:///KEY:SECRET@bucket`` passed the credential
check that looked only before the first ``/``; ``file://PATH`` reached fsspec's local
filesystem, where `reshard.safefs`'s containment of symlinks does not apply). `parse` is the
whole rule, checked before any import of fsspec or torch:

- the scheme is one of `SCHEMES` (object stores); ``file://``/``local://`` are refused with
  the way out (give the path itself, which `safefs` contains), other schemes and fsspec's
  ``::`` chains too;
- no ``@`` anywhere (userinfo, in whatever position, would be recorded in reports), no query
  or fragment, no control character;
- a bucket, then a key prefix whose parts are plain names (no empty, ``.`` or ``..`` part).

`overlaps` compares two parsed URLs as `os.path.realpath` compares local directories: one
store, one bucket, and one key prefix equal to or inside the other. (`reshard.render.redaction`
removes what looks like a credential from any text reshard prints or records: the last line
of defence; the first is that nothing reads or records credentials at all.)

Nothing here imports torch, fsspec or anything of reshard but its errors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.errors import BadInput

__all__ = ["SCHEMES", "StoreURL", "looks_like_url", "parse", "overlaps"]

#: The schemes reshard reads and writes as object stores, each with the store family it names
#: (``s3a`` is Hadoop's spelling of the same S3 bucket; ``gcs`` of ``gs``; the Azure ones of one account).
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
#: Schemes that name this machine's own file system: refused, the path itself goes through `safefs`.
LOCAL_SCHEMES = ("file", "local")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def looks_like_url(text: object) -> bool:
    """Whether a command-line argument is meant as a URL (``scheme://...`` or an fsspec chain), not
    a local path. A local path with ``://`` in it is not something a user types (``./s3://x`` still
    names one); what it then must satisfy is `parse`'s business."""
    return isinstance(text, str) and (_SCHEME.match(text) is not None or ("::" in text and "://" in text))


@dataclass(frozen=True)
class StoreURL:
    """A parsed object-store URL: ``scheme://bucket/key``, ``key`` without leading or trailing ``/``."""

    scheme: str
    bucket: str
    key: str

    @property
    def family(self) -> str:
        """The store the scheme names (``s3a`` and ``s3`` are one store)."""
        return SCHEMES[self.scheme]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.key.split("/")) if self.key else ()

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"


def _refuse(message: str, text: str, hint: str) -> BadInput:
    return BadInput(message, where=text, hint=hint)  # never a text with '@' (refused first, unechoed)


def parse(text: str, *, what: str = "URL") -> StoreURL:
    """``text`` as an object-store URL, or `BadInput` (exit 2) saying which rule it breaks.

    The credential refusal comes first and never echoes the URL: an ``@`` anywhere in it (the
    user part of ``s3://KEY:SECRET@bucket``, ``s3:///KEY:SECRET@bucket``, a key holding one) is
    refused with only the scheme shown."""
    if "@" in text:
        raise BadInput(f"credentials in the {what} are refused (an '@' anywhere in it; they would be recorded in "
                       "reports and manifests)", where=text.split("://", 1)[0][:16] + "://…",
                       hint="Give them through the standard chain: environment variables, config files or an "
                            "instance role (and rename a prefix that holds '@').")
    if "::" in text:
        raise _refuse(f"a chained {what} (fsspec's '::') is refused: each link would be a file system of its own, "
                      "outside what reshard checks", text, "Give one s3://bucket/prefix, or a local path.")
    if _CONTROL.search(text):
        raise _refuse(f"the {what} holds a control character (a newline, a tab, a NUL)", text.encode("unicode_escape").decode(),
                      "Give the URL without it.")
    m = _SCHEME.match(text)
    if m is None:
        raise _refuse(f"not an object-store {what}", text, "Give s3://bucket/prefix or a local directory.")
    scheme = m.group(1).lower()
    if scheme in LOCAL_SCHEMES:
        raise _refuse(f"a {scheme}:// {what} names this machine's own files", text,
                      f"Give the path itself ({text[m.end():] or '/'}): a local checkpoint is opened by its real "
                      "path, with every file contained in it (symlinks out are refused), which a URL would bypass.")
    if scheme not in SCHEMES:
        raise _refuse(f"the scheme '{scheme}://' is not an object store reshard reads or writes", text,
                      "Use one of " + ", ".join(f"{s}://" for s in SCHEMES) + ", or a local path.")
    rest = text[m.end():]
    if "?" in rest or "#" in rest:
        raise _refuse(f"a query or fragment ('?', '#') in the {what} is refused: it would change what is read "
                      "without being part of the name", text, "Give s3://bucket/prefix alone.")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise _refuse(f"the {what} names no bucket ('{scheme}:///...')", text, f"Give {scheme}://bucket/prefix.")
    key = key.strip("/")
    if key and any(p in ("", ".", "..") or "\\" in p for p in key.split("/")):
        raise _refuse(f"the {what}'s key prefix has an empty, '.' or '..' part", text,
                      "Give the prefix with plain names only (no '//', '.', '..' or backslash).")
    return StoreURL(scheme, bucket, key)


def overlaps(a: StoreURL, b: StoreURL) -> str | None:
    """How ``b`` lies against ``a`` in one store: ``"equal"``, ``"inside"`` (b under a), ``"above"``
    (a under b), or None when they share nothing. Key parts are compared whole, so ``ckpt`` and
    ``ckpt2`` do not overlap while ``ckpt`` and ``ckpt/sub`` do."""
    if a.family != b.family or a.bucket != b.bucket:
        return None
    pa, pb = a.parts, b.parts
    if pa == pb:
        return "equal"
    if pb[:len(pa)] == pa:
        return "inside"
    if pa[:len(pb)] == pb:
        return "above"
    return None
