"""Sidecars are data: every other file in a checkpoint directory is listed, read where safe, and carried.

Trainers keep state beside the DCP part: Lightning's `meta.pt` (step, epoch, scheduler
state), Megatron's `common.pt` and `metadata.json`, HF Accelerate's `scheduler.bin` and
`random_states_<rank>.pkl`. A converter that writes only `.metadata` and data files drops
them, and the trainer cannot resume from its output. So every file under the checkpoint root
that is not DCP's `.metadata`, a data file, or reshard's own file (`manifest.json`,
`local-index.json`, `reshard-report.json`/`.md`, which reshard writes anew) is a sidecar:

- `find_sidecars` lists them (relative path, size, SHA-256), each described by the first
  entry of ``formats/sidecars.toml`` whose pattern matches (format, writer, policy); a file
  no entry matches is ``opaque`` with policy ``carry (opaque)``;
- `read_content` reads one only when its format is known and safe: ``torch-weights-only``
  through `reshard.storage.checkpoints.dcp.torch_load_item` (``torch.load(weights_only=True)`` after
  `reshard.storage.pickles.safe_pickle`'s cost scan, never ``--trust-pickle``), ``json`` through
  `reshard.safefs.read_json`; a file that needs more is listed as not read, and still carried;
- `carry_sidecars` copies each byte-identical into a conversion's temporary output (before
  the atomic commit), checking the SHA-256 of the copy against the source's and the plan's.

Beside a checkpoint in a store (`reshard.storage.objectstore.remote.staged`), only the sidecars a reader may
open are fetched to describe it (`fetched_to_describe`); the others are listed from the store's
listing, their version tag standing for the SHA-256 (`STORE_TAG`), and fetched when a conversion
carries them, pinned to the version listed.

Files are opened through `reshard.safefs` like every other checkpoint file: a symlink out of
the checkpoint, a FIFO, a device or a socket is refused by name (exit 2); a symlink inside it
is followed (and one that names a data file is that data file, not a sidecar).
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from reshard import safefs
from reshard.errors import BadInput
from reshard.model.dtypes import is_torch_tensor
from reshard.paths import formats_root
if TYPE_CHECKING:  # handed down with the source
    from reshard.storage.objectstore.remote import RemoteCheckpoint

FORMATS = ("torch-weights-only", "json", "opaque")
POLICIES = ("carry", "rewrite")
OPAQUE_POLICY = "carry (opaque)"
RESHARD_OWN = frozenset({"manifest.json", "local-index.json", "reshard-report.json", "reshard-report.md"})
METADATA_FILE = ".metadata"
READ_LIMIT = 64 << 20          # a sidecar larger than this is listed and carried, never read
MAX_SIDECARS = 10_000          # a directory with more files than this is not a checkpoint
MAX_DEPTH = 8                  # subdirectories below the root that are walked
SUMMARY_KEYS = 64              # top-level keys described per read sidecar
REWRITERS: dict[str, Callable[[bytes, Any], bytes]] = {}  # rewriter name -> fn(source bytes, plan): new bytes
#: Name endings of files some reader of reshard's may open by name beside a checkpoint (configs,
#: profiles, trainer state, safetensors shards, reports): fetched when a checkpoint in a store is
#: staged. Any other file no format entry reads is opaque, described from the store's listing.
READ_SUFFIXES = (".json", ".toml", ".yaml", ".yml", ".pt", ".pth", ".bin", ".safetensors", ".txt", ".md", ".metadata")
#: What a sidecar described from a store's listing records instead of a SHA-256 it was never fetched for.
STORE_TAG = "store:"


@dataclass(frozen=True)
class SidecarRule:
    """One entry of formats/sidecars.toml."""

    pattern: str
    format: str
    writer: str
    policy: str
    per_rank: bool = False
    note: str = ""
    rewriter: str | None = None
    counters: tuple[tuple[str, str], ...] = ()  # (counter name, top-level key of the content), e.g. ("step", "iteration")


@dataclass
class Sidecar:
    """One file of the checkpoint directory that is not DCP's, as listed (content read on request)."""

    name: str           # path relative to the root, '/'-separated
    size: int
    sha256: str
    format: str
    policy: str         # "carry" | "carry (opaque)" | "rewrite"
    writer: str | None  # who writes it (None: unknown)
    per_rank: bool = False
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "size": self.size, "format": self.format, "policy": self.policy,
                             "writer": self.writer, "sha256": self.sha256}
        if self.per_rank:
            d["per_rank"] = True
        if self.note:
            d["note"] = self.note
        return d


@lru_cache(maxsize=1)
def sidecar_rules() -> tuple[SidecarRule, ...]:
    """formats/sidecars.toml, checked: every format and policy known, every rewriter shipped."""
    path = formats_root() / "sidecars.toml"
    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
        rules = []
        for r in spec.get("sidecar", []):
            rule = SidecarRule(str(r["pattern"]), str(r["format"]), str(r["writer"]), str(r["policy"]),
                               bool(r.get("per_rank", False)), str(r.get("note", "")), r.get("rewriter"),
                               tuple((str(k), str(v)) for k, v in r.get("counters", {}).items()))
            if rule.format not in FORMATS:
                raise ValueError(f"sidecar '{rule.pattern}': unknown format '{rule.format}' (known: {', '.join(FORMATS)})")
            if rule.policy not in POLICIES:
                raise ValueError(f"sidecar '{rule.pattern}': unknown policy '{rule.policy}' (known: {', '.join(POLICIES)})")
            if rule.policy == "rewrite" and rule.rewriter not in REWRITERS:
                raise ValueError(f"sidecar '{rule.pattern}': policy 'rewrite' needs a shipped rewriter, "
                                 f"got {rule.rewriter!r} (shipped: {', '.join(REWRITERS) or 'none'})")
            rules.append(rule)
        return tuple(rules)
    except (KeyError, ValueError, TypeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"invalid sidecar file: {exc}", where=str(path)) from None


def rule_for(name: str) -> SidecarRule | None:
    """The first entry whose pattern matches the relative path (or, for a pattern without '/', its last part)."""
    base = name.rsplit("/", 1)[-1]
    for rule in sidecar_rules():
        if fnmatch.fnmatchcase(name, rule.pattern) or ("/" not in rule.pattern and fnmatch.fnmatchcase(base, rule.pattern)):
            return rule
    return None


def fetched_to_describe(name: str) -> bool:
    """Whether a sidecar of a checkpoint in a store is fetched to describe it (`remote.staged`'s
    ``fetch``): reshard's own files, a format entry that reads its content, a name a reader may
    open (`READ_SUFFIXES`). The rest, e.g. 50,000 log files under ``logs/``, cost no request until
    a conversion carries them (issue 42)."""
    if name in RESHARD_OWN or name.lower().endswith(READ_SUFFIXES):
        return True
    rule = rule_for(name)
    return rule is not None and rule.format != "opaque"


def claimed_names(ix: Any) -> set[str]:
    """The names a checkpoint index accounts for itself: `.metadata` and its data files (named or present)."""
    return {METADATA_FILE, *getattr(ix, "file_sizes", {}), *ix.data_files()}


def find_sidecars(root: str | os.PathLike, claimed: Iterable[str], rc: RemoteCheckpoint | None = None) -> list[Sidecar]:
    """Every sidecar under ``root``, sorted by name; special files and symlinks out are `UnsafeFile` (exit 2).
    ``rc``: the store ``root`` stands for (a staged directory), whose sidecars not fetched are listed too."""
    real_root = safefs.resolve_root(root)
    claimed = set(claimed)
    claimed_real = {os.path.realpath(real_root / n) for n in claimed}
    out: list[Sidecar] = []
    for rel, path in _walk(real_root, claimed, claimed_real):
        fd = safefs.open_read(path, root=real_root)
        try:
            size = os.fstat(fd).st_size
            digest = _sha256_fd(fd)
        finally:
            os.close(fd)
        out.append(_described(rel, size, digest))
    if rc is not None:  # a checkpoint in a store: the sidecars not fetched, by their listed size and version
        for rel, size in rc.deferred.items():
            if rel not in claimed:
                out.append(_described(rel, size, STORE_TAG + rc.tags.get(rel, "")))
    return sorted(out, key=lambda c: c.name)


def _described(rel: str, size: int, digest: str) -> Sidecar:
    rule = rule_for(rel)
    if rule is None:
        return Sidecar(rel, size, digest, "opaque", OPAQUE_POLICY, None)
    return Sidecar(rel, size, digest, rule.format, rule.policy, rule.writer, rule.per_rank, rule.note)


def _walk(real_root: Path, claimed: set[str], claimed_real: set[str]) -> list[tuple[str, Path]]:
    """(relative name, path) of every file to account for, depth-first in sorted order."""
    found: list[tuple[str, Path]] = []
    stack: list[tuple[Path, str, int]] = [(real_root, "", 0)]
    while stack:
        folder, prefix, depth = stack.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name, reverse=True)
        for e in entries:
            rel = prefix + e.name
            if not prefix and (rel in claimed or rel in RESHARD_OWN):
                continue
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 > MAX_DEPTH:
                    raise BadInput(f"the checkpoint nests directories deeper than {MAX_DEPTH} levels", where=str(e.path),
                                   hint="A checkpoint directory holds its files and a few folders; point reshard at the checkpoint itself.")
                stack.append((Path(e.path), rel + "/", depth + 1))
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(e.path)
                if target in claimed_real:
                    continue  # a link to a data file (or to .metadata) is that file
                if os.path.isdir(target):
                    raise safefs.UnsafeFile("a symbolic link to a directory inside a checkpoint", where=str(e.path),
                                            hint="Copy the real files in (cp -rL) if you trust where the link points.")
            elif os.path.realpath(e.path) in claimed_real:
                continue  # the real file behind a symlinked data file
            found.append((rel, Path(e.path)))  # special files are refused when opened (safefs)
            if len(found) > MAX_SIDECARS:
                raise BadInput(f"the checkpoint directory holds more than {MAX_SIDECARS:,} files besides its data",
                               where=str(real_root), hint="Point reshard at the checkpoint directory itself.")
    return sorted(found)


def _sha256_fd(fd: int, slab: int = 8 << 20) -> str:
    h = hashlib.sha256()
    pos = 0
    while True:
        b = os.pread(fd, slab, pos)
        if not b:
            return h.hexdigest()
        h.update(b)
        pos += len(b)


def read_content(root: str | os.PathLike, car: Sidecar) -> dict[str, Any]:
    """What a sidecar holds, when its format is known and safe: ``{"read": True, "content": ...}``
    or ``{"read": False, "why": ...}``. Never raises for the content itself: a sidecar that cannot
    be read is still listed and carried."""
    if car.format == "opaque":
        return {"read": False, "why": "opaque: not read"}
    if car.sha256.startswith(STORE_TAG):
        return {"read": False, "why": "in the store, not fetched to describe the checkpoint"}
    if car.size > READ_LIMIT:
        return {"read": False, "why": f"{car.size:,} bytes, more than the {READ_LIMIT:,} reshard reads of a sidecar"}
    path = safefs.resolve_root(root) / car.name
    try:
        if car.format == "json":
            value = safefs.read_json(path, root=root, what=f"sidecar '{car.name}'", limit=READ_LIMIT)
        else:
            from reshard.storage.checkpoints.dcp import torch_load_item

            data = safefs.read_bounded(path, limit=READ_LIMIT, root=root, what=f"sidecar '{car.name}'")
            value = torch_load_item(data, key=car.name, where=str(path), trust_pickle=False)
    except BadInput as exc:  # UnsafeInput (a global outside weights_only) is a BadInput too
        return {"read": False, "why": exc.message}
    return {"read": True, "content": summarize(value)}


def summarize(value: Any, depth: int = 0) -> Any:
    """A JSON-safe description: scalars as they are, tensors by dtype and shape, containers by their keys."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not isinstance(value, str) or len(value) <= 200 else value[:200] + "..."
    if is_torch_tensor(value):
        if value.numel() == 1 and depth > 0:
            x = value.item()
            return {"tensor": str(value.dtype).removeprefix("torch."), "value": x}
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    if isinstance(value, dict):
        if depth >= 3:
            return {"dict": len(value)}
        items = list(value.items())
        out = {str(k): summarize(v, depth + 1) for k, v in items[:SUMMARY_KEYS]}
        if len(items) > SUMMARY_KEYS:
            out["..."] = f"{len(items) - SUMMARY_KEYS} more keys"
        return out
    if isinstance(value, (list, tuple)):
        scalars = all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
        if len(value) > 16 or (depth >= 2 and not scalars):
            return {type(value).__name__: len(value)}
        return [summarize(v, depth + 1) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    return {"type": type(value).__name__}


def inspect_section(ix: Any) -> list[dict[str, Any]]:
    """The inspect report's ``sidecars`` section: name, size, format, policy, writer, SHA-256 and,
    where the format is known and safe, the content. Empty for reshard's exports (their files are its own)."""
    from reshard.storage.checkpoints.hf_dcp import HfDcpIndex
    from reshard.storage.checkpoints.index import CheckpointIndex
    from reshard.storage.checkpoints.local_format import LocalIndex

    if not isinstance(ix, (CheckpointIndex, LocalIndex, HfDcpIndex)):
        return []
    out = []
    for car in find_sidecars(ix.root, claimed_names(ix), getattr(ix, "remote", None)):
        out.append({**car.to_dict(), **read_content(ix.root, car)})
    return out


def plan_entries(section: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """What a plan records of the source's sidecars (part of its fingerprint: the executor copies them)."""
    keep = ("name", "size", "format", "policy", "sha256")
    return [{k: s[k] for k in keep} for s in section or []]


def carry_sidecars(src: str | os.PathLike, out: str | os.PathLike, claimed: Iterable[str],
                   planned: list[dict[str, Any]] | None = None, rc: RemoteCheckpoint | None = None) -> list[dict[str, Any]]:
    """Copy every sidecar of ``src`` byte-identical into ``out`` (a conversion's temporary directory).

    ``planned`` (the plan's `plan_entries`): the source must still hold exactly those files with
    those bytes, else `BadInput` (the source changed since the plan; nothing is committed).
    A name that the output already holds (the converter wrote it) is refused, never overwritten.
    Returns the report's entries: name, size, format, policy, sha256, ``"carried": True``. ``rc``: the
    store ``src`` stands for (a staged directory), from which the sidecars not staged are fetched now.
    """
    real_src = safefs.resolve_root(src)
    found = find_sidecars(real_src, claimed, rc)
    if planned is not None:
        now = {(c.name, c.size, c.sha256) for c in found}
        then = {(p["name"], p["size"], p["sha256"]) for p in planned}
        if now != then:
            changed = sorted({n for n, _, _ in now ^ then})
            raise BadInput("the source's sidecar files changed since the plan was made: " + ", ".join(changed[:10]),
                           where=str(real_src), hint="Make the plan again (`reshard plan`) and convert with it.")
    out_root = Path(out)
    report = []
    for car in found:
        if car.policy not in ("carry", OPAQUE_POLICY):
            raise BadInput(f"sidecar '{car.name}' has policy '{car.policy}', which this version cannot apply",
                           where=str(real_src / car.name))
        dst = out_root / car.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if car.sha256.startswith(STORE_TAG):  # fetched now, at the version listed (reads are pinned to it)
            if dst.exists():
                raise BadInput(f"the source's sidecar '{car.name}' has the name of a file the conversion writes",
                               where=rc.where(car.name) if rc else str(real_src), hint="Rename or move the sidecar.")
            rc.fetch_to(car.name, dst, limit=car.size)
            fd = os.open(dst, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                digest = _sha256_fd(fd)
            finally:
                os.close(fd)
            report.append({**car.to_dict(), "sha256": digest, "carried": True, "fetched_from_the_store": True})
            continue
        digest = _copy(real_src / car.name, dst, root=real_src)
        if digest != car.sha256:
            raise BadInput(f"sidecar '{car.name}' changed while it was copied", where=str(real_src / car.name),
                           hint="Nothing was committed. Convert again once the writer has finished.")
        fd = os.open(dst, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            again = _sha256_fd(fd)
        finally:
            os.close(fd)
        if again != car.sha256:
            raise BadInput(f"the copy of sidecar '{car.name}' differs from the source", where=str(dst),
                           hint="Nothing was committed. The output file system corrupted the copy.")
        report.append({**car.to_dict(), "carried": True})
    return report


def _copy(src: Path, dst: Path, *, root: Path, slab: int = 8 << 20) -> str:
    """Stream ``src`` (through safefs) into a new file ``dst``; the SHA-256 of what was read."""
    fd = safefs.open_read(src, root=root)
    try:
        try:
            out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            raise BadInput(f"the source's sidecar '{dst.name}' has the name of a file the conversion writes",
                           where=str(src), hint="Rename or move the sidecar out of the checkpoint directory.") from None
        h = hashlib.sha256()
        try:
            pos = 0
            while True:
                b = os.pread(fd, slab, pos)
                if not b:
                    break
                h.update(b)
                view = memoryview(b)
                while view:
                    view = view[os.write(out, view):]
                pos += len(b)
            os.fsync(out)
        finally:
            os.close(out)
        return h.hexdigest()
    finally:
        os.close(fd)


def counters_from(section: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """Counter name -> (where, value) from sidecars whose entry names counters (Megatron's ``iteration``).

    Only integers read from a safely loaded sidecar count; the trainer keeps its step there
    when the DCP part has none.
    """
    out: dict[str, tuple[str, int]] = {}
    for s in section:
        rule = rule_for(s["name"])
        content = s.get("content")
        if rule is None or not s.get("read") or not isinstance(content, dict):
            continue
        for name, key in rule.counters:
            v = content.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and name not in out:
                out[name] = (f"{s['name']}:{key}", v)
    return out
