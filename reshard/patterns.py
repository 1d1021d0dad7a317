"""Regular expressions that come from a file or a flag, matched in linear time (RE2).

Python's `re` backtracks: a keep/drop pattern such as ``^(a|aa)+$`` in a ``reshard.toml``
that sits in a run folder (read without a flag) takes exponential time against a 41-character
key, and ``reshard plan`` never returns. Every pattern reshard reads from a user's or a
checkpoint's file (conventions, partition rules, rename rules, HF mappings, trainer formats,
profiles) or from a flag (``--keep``/``--drop``) is compiled here, by RE2, whose matching time
is linear in the text whatever the pattern. The price is RE2's syntax: no backreferences and
no lookarounds. Such a pattern is refused when it is read, naming where it came from, rather
than matched slowly later. Patterns reshard writes itself as literals stay on `re`.

`Pattern` answers what the callers use of `re.Pattern`: ``match``, ``fullmatch``, ``search``,
``finditer``, ``sub`` (with ``\\1`` and ``\\g<name>`` templates), ``groups``, ``groupindex``
and ``pattern``; its matches answer ``group``, ``groups``, ``groupdict`` and
``start``/``end``/``span`` by number or name (google-re2's own matches take numbers only).
It calls RE2's matcher directly on ASCII text (every checkpoint key reshard has met):
google-re2's wrapper costs ~5 us a call against ~1 us this way (`re`: ~0.3 us), and a
convention classifies millions of keys. Other text goes through google-re2's wrapper, which
maps UTF-8 byte offsets back to characters. `PatternSet` asks a list of patterns in one RE2
pass (a convention's rules, its markers), so classifying costs about what it did on `re`.
"""
from __future__ import annotations

from typing import Any, Iterator

import re2
from re2 import _re2

from reshard.errors import BadInput

__all__ = ["Match", "Pattern", "PatternError", "PatternSet", "compile_pattern"]

_HINT = ("Write it in RE2 syntax, which is Python's without backreferences (\\1, (?P=name)) and lookarounds "
         "((?=...), (?!...), (?<=...), (?<!...)): reshard matches patterns in time linear in the key, so that no "
         "pattern can make it run for ever.")
_NULL = (-1, -1)
_START, _BOTH, _ANY = _re2.RE2.Anchor.ANCHOR_START, _re2.RE2.Anchor.ANCHOR_BOTH, _re2.RE2.Anchor.UNANCHORED


class PatternError(BadInput):
    """A pattern from a file or a flag that RE2 cannot compile (exit 2)."""


class Match:
    """One match: the spans of its groups over ``string`` (group 0 the whole match)."""

    __slots__ = ("re", "string", "_spans")

    def __init__(self, pattern: "Pattern", string: str, spans: list[tuple[int, int]]):
        self.re, self.string, self._spans = pattern, string, spans

    def _index(self, group: int | str) -> int:
        i = self.re.groupindex.get(group) if isinstance(group, str) else group
        if not isinstance(i, int) or not 0 <= i <= self.re.groups:
            raise IndexError(f"no such group {group!r}")
        return i

    def span(self, group: int | str = 0) -> tuple[int, int]:
        return self._spans[self._index(group)]

    def start(self, group: int | str = 0) -> int:
        return self.span(group)[0]

    def end(self, group: int | str = 0) -> int:
        return self.span(group)[1]

    def __getitem__(self, group: int | str) -> str | None:
        a, b = self.span(group)
        return None if a < 0 else self.string[a:b]

    def group(self, *groups: int | str) -> Any:
        if len(groups) <= 1:
            return self[groups[0] if groups else 0]
        return tuple(self[g] for g in groups)

    def groups(self, default: Any = None) -> tuple[Any, ...]:
        return tuple(default if (v := self[i]) is None else v for i in range(1, self.re.groups + 1))

    def groupdict(self, default: Any = None) -> dict[str, Any]:
        s, spans = self.string, self._spans  # direct: a convention asks this of every key it explains
        return {name: default if spans[i][0] < 0 else s[spans[i][0]:spans[i][1]] for name, i in self.re.groupindex.items()}

    def __repr__(self) -> str:
        return f"<reshard.patterns.Match span={self.span()} match={self.group()!r}>"


class Pattern:
    """A pattern compiled by RE2, with the part of `re.Pattern`'s interface reshard uses (see the module)."""

    __slots__ = ("pattern", "groups", "groupindex", "_re2", "_prog")

    def __init__(self, compiled: Any):
        self._re2 = compiled              # google-re2's object: its wrapper handles non-ASCII text
        self._prog = compiled._regexp     # RE2 itself: called directly on ASCII text
        self.pattern: str = compiled.pattern
        self.groups: int = compiled.groups
        self.groupindex: dict[str, int] = dict(compiled.groupindex)

    def _slow(self, how: str, text: str) -> Match | None:
        m = getattr(self._re2, how)(text)  # google-re2's wrapper: maps UTF-8 offsets back to characters
        return None if m is None else Match(self, text, [m.span(i) for i in range(self.groups + 1)])

    # match/fullmatch/search: on ASCII text byte offsets are character offsets, so RE2 is called directly
    def match(self, text: str) -> Match | None:
        if not text.isascii():
            return self._slow("match", text)
        spans = self._prog.Match(_START, text.encode(), 0, len(text))
        return None if spans[0] == _NULL else Match(self, text, spans)

    def fullmatch(self, text: str) -> Match | None:
        if not text.isascii():
            return self._slow("fullmatch", text)
        spans = self._prog.Match(_BOTH, text.encode(), 0, len(text))
        return None if spans[0] == _NULL else Match(self, text, spans)

    def search(self, text: str) -> Match | None:
        if not text.isascii():
            return self._slow("search", text)
        spans = self._prog.Match(_ANY, text.encode(), 0, len(text))
        return None if spans[0] == _NULL else Match(self, text, spans)

    def match_groups(self, text: str, names: tuple[str, ...]) -> tuple[str | None, ...] | None:
        """The texts of the named groups (None: a group that does not take part, or the pattern has not)
        of a `match` of ``text``, or None when it does not match: what a convention reads of every key,
        without a `Match` object per key (a mixture of experts has hundreds of thousands)."""
        if not text.isascii():
            m = self.match(text)
            return None if m is None else tuple(m[n] if n in self.groupindex else None for n in names)
        spans = self._prog.Match(_START, text.encode(), 0, len(text))
        if spans[0] == _NULL:
            return None
        out = []
        for n in names:
            i = self.groupindex.get(n)
            a, b = spans[i] if i is not None else _NULL
            out.append(None if a < 0 else text[a:b])
        return tuple(out)

    def finditer(self, text: str) -> Iterator[Match]:
        for m in self._re2.finditer(text):
            yield Match(self, text, [m.span(i) for i in range(self.groups + 1)])

    def sub(self, repl: str, text: str, count: int = 0) -> str:
        """``text`` with (up to ``count``, 0: all) matches replaced by the template ``repl`` (``\\1``, ``\\g<name>``)."""
        return self._re2.sub(repl, text, count)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pattern) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(("reshard.patterns.Pattern", self.pattern))

    def __reduce__(self) -> tuple[Any, ...]:
        return _recompile, (self.pattern,)

    def __repr__(self) -> str:
        return f"reshard.patterns.Pattern({self.pattern!r})"


class PatternSet:
    """Which of several patterns `match` (or, with ``search``, `search`) a text, in one RE2 pass
    (RE2::Set): a convention's rules are tried on every key of a checkpoint, and one pass costs
    what one pattern's call does."""

    __slots__ = ("patterns", "search", "_set")

    def __init__(self, patterns: list[Pattern], *, search: bool = False):
        self.patterns, self.search = list(patterns), search
        self._set = _re2.Set(_ANY if search else _START, _options())
        for p in self.patterns:
            if self._set.Add(p.pattern.encode()) < 0:  # each compiled alone already: cannot fail
                raise PatternError(f"the pattern {p.pattern!r} cannot join a set", where="reshard.patterns")
        if self.patterns and not self._set.Compile():
            raise PatternError("a set of patterns does not compile", where="reshard.patterns")

    def __reduce__(self) -> tuple[Any, ...]:
        return _pattern_set, (self.patterns, self.search)

    def matching(self, text: str) -> list[int]:
        """The indices, in order, of the patterns whose ``match`` (``search``) finds ``text``."""
        if not self.patterns:
            return []
        return sorted(self._set.Match(text.encode()))


def _pattern_set(patterns: list[Pattern], search: bool) -> PatternSet:
    return PatternSet(patterns, search=search)


def _recompile(text: str) -> Pattern:
    return compile_pattern(text, "a pattern reshard compiled before")


def _options() -> Any:
    opts = re2.Options()
    opts.log_errors = False  # the error is ours to report, in one paragraph, not RE2's line on stderr
    return opts


def compile_pattern(text: Any, where: str, *, what: str = "pattern", hint: str | None = None) -> Pattern:
    """``text`` compiled by RE2, or `PatternError` naming ``where`` (a file or a flag), the pattern and the way out.

    ``what`` says which pattern it is in the message (e.g. "[[rule]] match", "--keep pattern").
    """
    if not isinstance(text, str):
        raise PatternError(f"the {what} must be a string, got {text!r}", where=where)
    try:
        return Pattern(re2.compile(text, _options()))
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise PatternError(f"the {what} {text!r} is not a regular expression reshard can match (RE2: {reason})",
                           where=where, hint=hint or _HINT) from None
