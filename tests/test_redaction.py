"""`reshard.render.redaction.redact` runs each pattern only on the lines holding its literal anchor
(issue 45 follow-up): the result must be exactly that of the patterns over the whole text, for every
credential form redacted before. The reference below is the whole-text algorithm, kept here; the
inputs are credential fragments joined at random (with newlines, word characters and Unicode that
case-folds to ASCII). Cost: about a second, no checkpoint."""
from __future__ import annotations

import os
import random
import re

import pytest

from reshard.render.redaction import redact

_SECRET = "supersecretvalue1"


def _reference(text: str) -> str:
    """The whole-text redaction, as it was before the anchors."""
    if not text:
        return text
    out = re.compile(r"(://)/*[^/@\s]*@").sub(r"\1<redacted>@", text)
    out = re.compile(r"[^\s/@:'\"=]+:[^\s/@'\"]+@").sub("<redacted>@", out)
    out = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|AIPA)[A-Z0-9]{12,}\b").sub("<redacted>", out)
    out = re.compile(r"(?i)\b(X-Amz-(?:Credential|Signature|Security-Token)|sig|signature)=[^&\s'\"]+").sub(
        lambda m: f"{m.group(1)}=<redacted>", out)
    for name, value in os.environ.items():
        if (len(value) >= 8 and re.search(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY|ACCOUNT_KEY|SAS_", name, re.I)
                and not re.search(r"_(FILE|PATH|DIR|URL|ENDPOINT)$", name, re.I) and value in out):
            out = out.replace(value, "<redacted>")
    return out


FRAGMENTS = ["s3://user:pw@bucket/x", "AKIAABCDEFGHIJKLMNOP", "ASIA1234567890ABCD", "X-Amz-Signature=abc&x=1", "sig=ff",
             "SIGNATURE=zz", "x-amz-credential=AKIA/2020", "https:///K:S@h", "KEY:SECRET@", _SECRET, "dp=4",
             "\n", "\r\n", " ", "\t", "a", "_", "=", "@", ":", "/", "&", "'", '"', "İ", "ſig=1", "é"]


@pytest.mark.parametrize("text", [
    "", "no credential at all\n", "s3://AKIAABCDEFGHIJKLMNOP:secret@bucket/key", "https://h/p?X-Amz-Signature=ab12&x=1",
    "a\nsig=1\nb", f"line\n{_SECRET}\n", '{\n  "url": "s3://u:p@b/k",\n  "to": "dp=4"\n}',
])
def test_each_form_redacted_as_before(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("MY_API_TOKEN", _SECRET)
    assert redact(text) == _reference(text)
    for secret in ("pw@", ":secret@", "ab12", _SECRET):
        assert secret not in redact(text) or secret not in text


def test_random_texts_equal_the_whole_text_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_API_TOKEN", _SECRET)
    rng = random.Random(45)
    for _ in range(5_000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        assert redact(text) == _reference(text), repr(text)


def test_a_large_text_without_anchors_is_scanned_not_matched() -> None:
    """The fast path: no anchor, so no pattern runs and the text comes back as itself."""
    text = '{\n  "key": "model.layers.0.weight"\n}\n' * 1000
    assert redact(text) is text
