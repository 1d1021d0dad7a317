"""A source opened once and handed down (issue 44, item 2): `reshard.storage.source.Source`.

- `test_no_module_looks_a_source_up`: reads every module of ``reshard/`` (ast, no import) and
  fails on a call of ``remote_of`` or ``is_url`` outside the few modules allowed to: the
  `Source` itself and the store module that defines ``is_url``, the store output, and the
  argument checks made before a `Source` exists; the two registries (``remote_of``, and
  ``output_name`` for outputs) are gone and may not come back.
- `test_two_sources_over_two_prefixes_share_nothing`: two store prefixes opened at once: each
  `Source` has its own staged directory, `RemoteCheckpoint`, counters and readers, and each
  reader reads through its own source's handle.
- `test_a_store_source_reads_an_item_through_its_own_handle`: an item of a store source read
  through `Source.reader()` is the local copy's bytes, fetched by range through the source's
  `RemoteCheckpoint` (its counters move), with no registry consulted.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from s3_server import s3_server

ROOT = Path(__file__).resolve().parents[1] / "reshard"

#: Where a look-up of a path's store (`remote_of`) or of a text's kind (`is_url`) may stay.
ALLOWED = {
    "storage/source.py",     # the Source: the one place a command's text becomes a checkpoint opened
    "storage/objectstore/remote.py",     # their definitions
    "storage/objectstore/upload.py",     # the store output (a destination, not a source)
    "engine/publishing.py",  # the store output
    # argument checks of what the user typed, before any Source exists (`arguments.is_url`; the
    # CLI and the API call it for a destination: whether the output is the store output)
    "arguments.py", "cli.py", "api.py",
}
LOOKUPS = {"remote_of", "is_url", "output_name", "register_output"}  # the two registries, gone: they stay gone


def _lookups(path: Path) -> list[int]:
    """Lines of ``path`` that call or import a look-up by name (``remote_of(x)``, ``remote.is_url(x)``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in LOOKUPS:
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name in LOOKUPS for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in LOOKUPS and not isinstance(node.ctx, ast.Store):
            lines.append(node.lineno)  # handed on without a call (``map(remote.remote_of, ...)``)
    return sorted(set(lines))


def test_no_module_looks_a_source_up():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        found += [f"reshard/{rel}:{line}" for line in _lookups(path)]
    assert not found, ("a source is handed down as a `Source` (reshard.storage.source), never looked up by its "
                       "path or text:\n" + "\n".join(found))
    assert all((ROOT / rel).exists() for rel in ALLOWED), "an allowed module is gone: shorten ALLOWED"


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def two_urls(s3, plain_fsdp2_ckpt) -> tuple[str, str]:
    return s3.upload(plain_fsdp2_ckpt, "source-a"), s3.upload(plain_fsdp2_ckpt, "source-b")


def test_two_sources_over_two_prefixes_share_nothing(two_urls):
    from reshard.storage.source import opened

    url_a, url_b = two_urls
    with opened(url_a) as a, opened(url_b) as b:
        assert (a.url, b.url) == (url_a, url_b) and a.display == url_a and b.name == url_b
        assert a.root != b.root and a.remote is not b.remote and a.remote.counters is not b.remote.counters
        ra, rb = a.reader(), b.reader()
        assert ra is a.reader() and rb is b.reader() and ra is not rb  # each its own, opened once
        assert ra.remote is a.remote and rb.remote is b.remote and ra.root == a.root and rb.root == b.root
        before_b = b.remote.counters.to_dict()
        key = next(k for k, e in ra.entries.items() if not e.is_tensor and e.location is not None)
        ra.read_object(key)
        assert a.remote.counters.requests > 0
        assert b.remote.counters.to_dict() == before_b  # reading A cost B nothing
        assert a.store_reads()["listings"] == b.store_reads()["listings"] == 1
    assert not a.root.exists() and not b.root.exists()


def test_a_store_source_reads_an_item_through_its_own_handle(two_urls, plain_fsdp2_ckpt):
    from reshard.storage.checkpoints import dcp
    from reshard.storage.checkpoints.index import CheckpointIndex
    from reshard.storage.source import Source, opened

    local = Source.local(plain_fsdp2_ckpt).reader()
    assert local.remote is None
    with opened(two_urls[0]) as source:
        ix = source.reader()
        assert isinstance(ix, CheckpointIndex) and ix.remote is source.remote
        e = next(e for e in ix.entries.values() if e.is_tensor and e.numel > 1)
        loc = e.chunks[0].location
        asked = source.remote.counters.bytes
        got = dcp.read_item_bytes(source.root, loc, key=e.key, rc=source.remote)
        assert source.remote.counters.bytes - asked == loc.length  # fetched by range, through its own handle
        want = dcp.read_item_bytes(plain_fsdp2_ckpt, local.entries[e.key].chunks[0].location, key=e.key)
        assert got == want
        with pytest.raises(Exception, match="missing"):  # without the handle: the staged directory holds no data file
            dcp.read_item_bytes(source.root, loc, key=e.key)
