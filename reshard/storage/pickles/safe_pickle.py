"""An allow-listing unpickler for DCP's `.metadata`, and a cost bound for any pickle.

Stock DCP reads `.metadata` with ``pickle.load``: a crafted file runs code the moment it is
opened (pytorch #189308). Here every global the pickle names is looked up in
``formats/dcp_metadata.toml`` and replaced by an inert stand-in; reshard never imports or
calls a class the pickle asks for. Anything not listed is refused before it is built.
Deciding is a dictionary lookup and nothing else: ``torch.<dtype>`` names are resolved
through the table of torch's dtypes in `reshard.model.dtypes` (never ``getattr(torch, name)``
on a name taken from the file, which would import whatever lazy submodule the file names, such
as ``torch._inductor``). Nothing here imports torch.

**Memory proportional to the input.** Before `.metadata` is unpickled, `pickle_cost`
walks its opcodes once and counts what they would build, with memo references counted as
the whole object they re-use: a `.metadata` of N bytes may build at most
``COST_PER_BYTE * N + COST_SLACK`` units (8 per byte plus 64 Ki; a unit is one object, one
container slot or 8 bytes of string) and is refused (exit 2, the file named) past that.
Real DCP metadata costs 1-2 units per byte. The unpickler itself then holds at most one
object per opcode plus the copies its stand-ins make (counted), and everything downstream
walks a tree of at most that many units. The same scan bounds the ``data.pkl`` of every
item `reshard.storage.checkpoints.dcp` loads with ``torch.load``.
"""
from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
import tomllib
from functools import lru_cache
from typing import Any

from reshard.errors import BadInput, UnsafeInput
from reshard.model.dtypes import DTYPES
from reshard.paths import formats_root


class Record:
    """Inert stand-in for a DCP metadata dataclass: an attribute bag, nothing more.

    No ``__new__`` and no ``__setstate__``: the C unpickler creates it with ``object.__new__``
    and applies a dataclass's state dict (or a slotted class's ``(dict, slots)`` pair) itself,
    at C speed, once per chunk record. Any other state is refused by the unpickler. Classes
    that pickle their state as a tuple are `TupleRecord`.
    """

    _tuple_state: tuple[str, ...] = ()
    _key_fields: tuple[str, ...] = ()
    _qualname = "Record"

    def __setstate__(self, state: Any) -> None:
        """BUILD with a dataclass's state dict: that dict becomes this record's ``__dict__``.

        torch's pickler memoizes the state dict, so the unpickler holds it until the load ends
        anyway; adopting it instead of copying it into a second dict (what the C unpickler does
        for a class without ``__setstate__``) keeps one dict per record: a third less memory
        for a million-chunk `.metadata`. A slotted class's ``(dict, slots)`` pair is merged."""
        if type(state) is dict:
            self.__dict__ = state
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], (dict, type(None))) \
                and isinstance(state[1], (dict, type(None))):
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            self.__dict__ = merged
        else:
            raise pickle.UnpicklingError(f"unexpected state for {self._qualname}: {type(state).__name__}")

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __hash__(self) -> int:
        d = self.__dict__
        return hash(tuple([_hashable(d.get(f)) for f in self._key_fields]))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        fields = self._key_fields or tuple(sorted(set(self.__dict__) | set(other.__dict__), key=repr))
        return all(_hashable(self.__dict__.get(f)) == _hashable(other.__dict__.get(f)) for f in fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{self._qualname}({inner})"


class TupleRecord(Record):
    """A record whose class pickles its state as a tuple (TensorProperties): named by ``_tuple_state``."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            self.__dict__.update(zip(self._tuple_state, state))
        elif isinstance(state, dict):  # an older writer that pickled it as a dataclass
            self.__dict__.update({str(k): v for k, v in state.items()})
        else:
            raise pickle.UnpicklingError(f"unexpected state for {self._qualname}: {type(state).__name__}")


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(v)
    return v


def _size(*args: Any) -> tuple[int, ...]:
    if len(args) != 1 or not isinstance(args[0], (tuple, list)):
        raise pickle.UnpicklingError("torch.Size expects one tuple argument")
    vals = tuple(args[0])
    if not {*map(type, vals)} <= INT_ONLY:  # one C-level pass; bool is not int here
        raise pickle.UnpicklingError("torch.Size holds non-integers")
    return vals


INT_ONLY = frozenset((int,))
"""``{*map(type, t)} <= INT_ONLY``: every member of ``t`` is exactly an int (not a bool), at C speed."""


def _layout(name: Any) -> str:
    if not isinstance(name, str):
        raise pickle.UnpicklingError("a layout is named by a string")
    return name


def _enum_value(value: Any) -> Any:
    if not isinstance(value, (int, str)):
        raise pickle.UnpicklingError("enum value must be an int or a string")
    return value


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("path parts must be strings")
    return "/".join(parts)


def _ordered_dict(*args: Any) -> dict:
    if args:
        raise pickle.UnpicklingError("OrderedDict with arguments is not expected")
    return {}


@lru_cache(maxsize=1)
def _allow_list() -> dict[tuple[str, str], Any]:
    with open(formats_root() / "dcp_metadata.toml", "rb") as f:
        spec = tomllib.load(f)
    table: dict[tuple[str, str], Any] = {}
    for entry in spec["allow"]:
        module, name, kind = entry["module"], entry["name"], entry["kind"]
        if kind == "record":
            cls = type(name, (TupleRecord if entry.get("tuple_state") else Record,), {
                "_qualname": name,
                "_tuple_state": tuple(entry.get("tuple_state", ())),
                "_key_fields": tuple(entry.get("key_fields", ())),
            })
            table[(module, name)] = cls
        else:
            table[(module, name)] = {
                "size": _size, "layout": _layout, "enum": _enum_value, "path": _path,
                "ordered_dict": _ordered_dict, "dtype": "dtype",
            }[kind]
    return table


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves globals only through the allow list."""

    def __init__(self, file: io.BufferedIOBase, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        table = _allow_list()
        found = table.get((module, name))
        if found is None and table.get((module, "*")) == "dtype":
            found = DTYPES.get(name)
        if found is None or found == "dtype":
            raise UnsafeInput(
                f"refusing to unpickle global '{module}.{name}': it is not part of DCP metadata "
                "and loading it could execute code",
                where=self.where,
                hint="The file was not written by torch.distributed.checkpoint or has been tampered with; "
                "do not open it with stock tools either.",
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeInput("persistent ids are not part of DCP metadata", where=self.where)


def load_metadata_pickle(data: bytes, where: str) -> Any:
    """Unpickle `.metadata` bytes safely; bad or hostile bytes become BadInput/UnsafeInput.

    The cost scan runs first, so an amplifying pickle is refused before anything is built.
    """
    check_cost(data, where=where, what="the checkpoint metadata pickle")
    try:
        return MetadataUnpickler(io.BytesIO(data), where).load()
    except UnsafeInput:
        raise
    except RecursionError:
        raise BadInput("metadata pickle nests too deeply", where=where)
    except (pickle.UnpicklingError, TypeError) as exc:
        misuse = value_misuse(str(exc))
        if misuse is None:
            raise _unparsable(exc, where) from None
        raise BadInput(f"refusing the checkpoint metadata pickle: {misuse}", where=where,
                       hint="No pickler writes this (a memo fetch of another object than the one its place "
                            "needs, or a forged value); the file is forged or corrupt: restore it from its writer "
                            "or use another checkpoint.") from None
    except (EOFError, ValueError, AttributeError, IndexError,
            KeyError, UnicodeDecodeError, OverflowError, MemoryError, ImportError, struct_error()) as exc:
        raise _unparsable(exc, where) from None


def _unparsable(exc: BaseException, where: str) -> BadInput:
    return BadInput(
        f"cannot parse the checkpoint metadata ({type(exc).__name__}: {exc})",
        where=where,
        hint="The file is truncated or corrupt; restore it from the writer or use another checkpoint.",
    )


# What the C unpickler (and the stand-ins here) say when a value of one kind is used where the pickle
# needs another (the way a memo fetch of the wrong index shows), and the same in DCP's terms.
_MISUSES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), w) for p, w in (
    (r"unhashable type: '([^']+)'",
     "it uses a {0} (or a record whose key fields hold one) as a dict key or set member, which cannot be one "
     "(DCP's keys are strings and MetadataIndex records)"),
    (r"^'([^']+)' object is not callable",
     "it calls a {0} as if it were a class or function (REDUCE of a value DCP's pickler never calls)"),
    (r"^NEWOBJ class argument must be a type, not (\w+)",
     "it builds an object from a {0} where a class belongs (NEWOBJ of a value that is not one of DCP's classes)"),
    (r"^NEWOBJ class argument isn't a type object", "it builds an object from a value that is not a class (NEWOBJ)"),
    (r"^(\w+)\(\) takes no arguments", "it calls the record class {0} with arguments, which DCP's pickler never "
                                       "gives it (records are built empty, then given their state)"),
    (r"^STACK_GLOBAL requires str", "it names a global by a value that is not a string (STACK_GLOBAL)"),
    (r"^unexpected state for (\w+): (\w+)", "it gives the {0} record a {1} as its state, where DCP's pickler gives "
                                           "a dict of its fields"),
))


def value_misuse(message: str) -> str | None:
    """What a pickle does wrong, in DCP's terms, when the unpickler refused a value of the wrong kind
    (``message``: the exception's text); None for any other refusal."""
    for pattern, words in _MISUSES:
        m = pattern.search(message)
        if m:
            return words.format(*m.groups())
    return None


def struct_error() -> type[Exception]:
    import struct

    return struct.error


# ---------------------------------------------------------------------------- cost bound
#
# How much a pickle may build, decided before anything is built. A pickle of N bytes runs
# at most N opcodes, but a memo reference (BINGET) re-uses a whole built object for two to
# five bytes, so a megabyte can describe a tree of gigabytes: a list of a million
# references to a list of a million items, a tuple of a thousand references to a 500 KB
# string that a stand-in joins into one path, one large state dict applied to a million
# records. Whoever walks or copies the result (the stand-ins here, the metadata decoder,
# ``repr`` in an error, a comparison) pays for the expanded tree, so that is what is counted.

COST_PER_BYTE = 8
"""At most this many units built per input byte (see `pickle_cost`). Measured on DCP's own
files: `.metadata` costs 1.0 units per byte (reshard.testing.synthetic.make_plain_fsdp2, 4 ranks) to
1.4 (make_many_entries, 20,000 entries, 100,000 records); the data.pkl of a torch.save object
item at most 0.3. 8 leaves a margin of more than 5 for longer key names and deeper records."""
COST_SLACK = 1 << 16
"""Units any pickle may build whatever its size (a small pickle of a few long strings)."""
CUT_SHORT = ("truncated", "a length runs past the end of the pickle")
"""How the cost scan (costscan.c, and its Python twin) says that a pickle's bytes end before its opcodes do."""


class PickleTooCostly(ValueError):
    """The pickle would build more than its budget, or cannot be scanned (malformed, unsupported opcode)."""


SELF_REFERENCE = "an object is changed after a reference to it was taken"
"""What both scans say when a container or record is changed after a memo reference (or DUP) to it was
taken: the only way a pickle builds an object that contains itself (a list holding itself, a chunk whose
field points back to the metadata), which neither DCP nor torch.save ever writes."""


class PickleSelfReference(PickleTooCostly):
    """The pickle builds an object that refers to itself (`SELF_REFERENCE`): refused as a forgery, not as a cost."""


class PickleMemoFault(PickleTooCostly):
    """The pickle misuses its memo: it fetches an index it never set, sets an index beyond its own length, or
    sets one index twice. A pickler sets each index once, as it builds the object, and fetches only what it set;
    refused as a forgery, not as a cost (the message starts ``memo index N``, in both scans)."""


def _memo_fault(detail: str) -> bool:
    """Whether a refusal of either scan is a `PickleMemoFault` (the native scan answers with its message only)."""
    return detail.startswith("memo index ")


def pickle_budget(n_bytes: int) -> int:
    """The most a pickle of ``n_bytes`` may cost: ``COST_PER_BYTE * n_bytes + COST_SLACK`` units."""
    return COST_PER_BYTE * n_bytes + COST_SLACK


_TEXT_OPS = {ord(c): pickletools.code2op[c] for c in "ILFSVpgciP"}
_U4 = struct.Struct("<I")
_I4 = struct.Struct("<i")
_U8 = struct.Struct("<Q")
_FIXED = {0x4B: 1, 0x4D: 2, 0x4A: 4, 0x47: 8}  # BININT1, BININT2, BININT, BINFLOAT: an argument of this size
_ATOMS = frozenset((0x4E, 0x88, 0x89))  # NONE, NEWTRUE, NEWFALSE
_LEN1 = frozenset((0x8C, 0x55, 0x43, 0x8A))  # SHORT_BINUNICODE, SHORT_BINSTRING, SHORT_BINBYTES, LONG1
_LEN4 = frozenset((0x58, 0x42))  # BINUNICODE, BINBYTES
_LEN4_SIGNED = frozenset((0x54, 0x8B))  # BINSTRING, LONG4
_LEN8 = frozenset((0x8D, 0x8E, 0x96))  # BINUNICODE8, BINBYTES8, BYTEARRAY8


try:  # the same scan in C, built by setup.py where a compiler exists (tests/test_costscan.py compares the two)
    from reshard.storage.pickles import costscan as native_scan
except ImportError:  # no compiler at install time: the Python scan below, about 40 times slower
    native_scan = None

NATIVE_LIMIT = 1 << 60
"""Budgets up to this go to the native scan, whose weights saturate at 2^61."""


def pickle_cost(data: bytes | bytearray | memoryview, *, limit: int) -> int:
    """Units the pickle in ``data`` builds, counted without building anything; raises past ``limit``.

    The native scan (``reshard/storage/pickles/costscan.c``) when it is built, else `python_pickle_cost`:
    the same algorithm, the same answers and messages. Protocol-0 text opcodes, which neither
    DCP nor torch.save writes, are always scanned in Python.
    """
    if native_scan is not None and 0 <= limit < NATIVE_LIMIT:
        r = native_scan.scan(data, limit)
        if r.__class__ is int:
            return r
        code, at, detail = r
        if code == 0:
            kind = (PickleSelfReference if detail == SELF_REFERENCE else
                    PickleMemoFault if _memo_fault(detail) else PickleTooCostly)
            raise kind(f"{detail} (opcode at byte {at})")
        if code == 1:
            raise PickleTooCostly(f"the pickle ends without STOP (at byte {at})")
        if code == 3:
            raise PickleTooCostly(f"{_unused_opcode(detail)} (opcode at byte {at})")
    return python_pickle_cost(data, limit=limit)


def _unused_opcode(op: int) -> str:
    """The refusal of an opcode neither scan admits, in the same words from both."""
    known = pickletools.code2op.get(chr(op))
    return f"opcode {known.name if known else hex(op)} is not used by DCP metadata or torch.save"


def python_pickle_cost(data: bytes | bytearray | memoryview, *, limit: int) -> int:
    """`pickle_cost` in Python: the reference the native scan is tested against.

    A unit is one object, one container slot or eight bytes of a string, on the result tree
    *expanded*: a value weighs 1 plus what it holds, so a memo reference to a container
    weighs the whole container again. The cost is the weight of the result plus the weight
    of every argument a constructor receives (REDUCE, NEWOBJ, BUILD's state, each dict key,
    which is hashed): the work a stand-in does copying or walking it. Refused
    (`PickleTooCostly`) as soon as any weight or the total passes ``limit``, and also:

    - a container changed after a second reference to it was taken (memo get, DUP): its
      weight was already counted where it was referenced. Real pickles refer back only to
      finished objects (DCP metadata and torch.save object items hold no cycles);
    - a memo misused (`PickleMemoFault`): an index above the pickle's length (the C unpickler
      sizes its memo array by the largest index it is given), a fetch of an index never set, an
      index set twice (a pickler sets each once, as it builds the object: a second PUT would make
      later fetches name another object than the first ones);
    - a length running past the end, an unknown opcode, the copyreg extension registry and
      out-of-band buffers (neither DCP nor torch.save uses them).

    One pass over the bytes with a stack of integers, stopping at STOP as the unpickler does.
    """
    mv = data if isinstance(data, bytes) else bytes(data)
    n = len(mv)
    stack: list[Any] = []  # an int: the weight of an immutable value; a list [weight, shared]: a mutable one
    append = stack.append
    marks: list[int] = []
    memo: dict[int, Any] = {}
    fence = 0  # the stack position of the innermost MARK (marks[-1]), or 0
    work = 0
    pos = 0
    at = [0]  # where the current opcode is, for messages
    text: io.BytesIO | None = None
    u4 = _U4.unpack_from

    def bad(what: str) -> PickleTooCostly:
        return (PickleMemoFault if _memo_fault(what) else PickleTooCostly)(f"{what} (opcode at byte {at[0]})")

    def over() -> PickleTooCostly:
        return bad(f"it builds more than its budget of {limit} units")

    def weigh(items: list[Any]) -> int:
        return sum(x if x.__class__ is int else x[0] for x in items)

    def target(x: Any) -> list:
        if x.__class__ is int:
            raise bad("items are given to a value that cannot hold them")
        if x[1]:
            raise PickleSelfReference(f"{SELF_REFERENCE} (opcode at byte {at[0]})")
        return x

    def to_mark() -> list[Any]:
        if not marks:
            raise bad("an opcode that needs a MARK has none")
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    def pop() -> Any:
        if len(stack) <= (marks[-1] if marks else 0):
            raise bad("stack underflow")
        return stack.pop()

    def top() -> Any:
        if len(stack) <= (marks[-1] if marks else 0):
            raise bad("stack underflow")
        return stack[-1]

    def put(idx: int) -> None:
        if idx > n:
            raise bad(f"memo index {idx} is larger than the pickle")
        x = top()
        if idx in memo:
            raise bad(f"memo index {idx} is set twice")
        memo[idx] = x

    def get(idx: int) -> None:
        x = memo.get(idx)
        if x is None:
            raise bad(f"memo index {idx} was never set")
        if x.__class__ is not int:
            x[1] = 1
        append(x)

    def length(pos: int, size: int, signed: bool = False) -> tuple[int, int]:
        """(the length stored at ``pos`` in ``size`` bytes, the position after the value it counts)."""
        if pos + size > n:
            raise bad("truncated")
        ln = mv[pos] if size == 1 else (_I4 if signed else _U4).unpack_from(mv, pos)[0] if size == 4 else _U8.unpack_from(mv, pos)[0]
        end = pos + size + ln
        if ln < 0 or end > n:
            raise bad("a length runs past the end of the pickle")
        return ln, end

    try:
        while True:
            op = mv[pos]  # IndexError past the end: "ends without STOP" below
            at[0] = pos
            pos += 1
            # the opcodes of DCP metadata, most frequent first, inlined
            if op == 0x94:  # MEMOIZE (the next index: never above the pickle's length)
                if len(stack) <= fence:
                    raise bad("stack underflow")
                idx = len(memo)
                if idx in memo:  # an index a BINPUT took: MEMOIZE would rebind it
                    raise bad(f"memo index {idx} is set twice")
                memo[idx] = stack[-1]
            elif op == 0x68 or op == 0x6A:  # h BINGET, j LONG_BINGET
                idx = mv[pos] if op == 0x68 else u4(mv, pos)[0]
                pos += 1 if op == 0x68 else 4
                x = memo.get(idx)
                if x is None:
                    raise bad(f"memo index {idx} was never set")
                if x.__class__ is not int:
                    x[1] = 1
                append(x)
            elif op == 0x85:  # TUPLE1
                if len(stack) <= fence:
                    raise bad("stack underflow")
                x = stack[-1]
                stack[-1] = 1 + (x if x.__class__ is int else x[0])
            elif op == 0x28:  # ( MARK
                fence = len(stack)
                marks.append(fence)
            elif op == 0x29:  # ) EMPTY_TUPLE
                append(1)
            elif op == 0x81 or op == 0x52:  # NEWOBJ, R REDUCE: cls/callable args -> a new object
                if len(stack) < fence + 2:
                    raise bad("stack underflow")
                x = stack.pop()
                add = x if x.__class__ is int else x[0]
                work += add
                if work > limit:
                    raise over()
                stack[-1] = [1 + add, 0]
            elif op == 0x62:  # b BUILD: obj state -> obj (state applied to it)
                x = pop()
                t = target(top())
                add = x if x.__class__ is int else x[0]
                t[0] += add
                work += add
                if t[0] > limit or work > limit:
                    raise over()
            elif op in _FIXED:
                pos += _FIXED[op]
                append(1)
            elif op == 0x75 or op == 0x73:  # u SETITEMS, s SETITEM
                if op == 0x75:
                    items = to_mark()
                    fence = marks[-1] if marks else 0
                else:
                    v = pop()
                    items = [pop(), v]
                if len(items) % 2:
                    raise bad("odd number of items for SETITEMS")
                t = target(top())
                keys = weigh(items[0::2])
                t[0] += keys + weigh(items[1::2])
                work += keys  # keys are hashed: a record's hash walks its key fields
                if t[0] > limit or work > limit:
                    raise over()
            elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
                append([1, 0])
            elif op in _ATOMS:
                append(1)
            elif op in _LEN1:
                ln, pos = length(pos, 1)
                append(1 + ln // 8)
            elif op == 0x61:  # a APPEND
                x = pop()
                t = target(top())
                t[0] += x if x.__class__ is int else x[0]
                if t[0] > limit:
                    raise over()
            elif op == 0x65 or op == 0x90:  # e APPENDS, ADDITEMS
                items = to_mark()
                fence = marks[-1] if marks else 0
                t = target(top())
                add = weigh(items)
                t[0] += add
                if op == 0x90:
                    work += add  # set members are hashed
                if t[0] > limit or work > limit:
                    raise over()
            elif op == 0x86 or op == 0x87:  # TUPLE2, TUPLE3
                k = op - 0x84
                if len(stack) - k < fence:
                    raise bad("stack underflow")
                w = 1 + weigh(stack[-k:])
                del stack[-k:]
                if w > limit:
                    raise over()
                append(w)
            elif op in (0x74, 0x6C, 0x64, 0x91):  # t TUPLE, l LIST, d DICT, FROZENSET: MARK items... op
                items = to_mark()
                fence = marks[-1] if marks else 0
                w = 1 + weigh(items)
                if op == 0x64:
                    work += weigh(items[0::2])
                elif op == 0x91:
                    work += w
                if w > limit or work > limit:
                    raise over()
                append([w, 0] if op in (0x6C, 0x64) else w)
            elif op == 0x71:  # q BINPUT
                put(mv[pos])
                pos += 1
            elif op == 0x72:  # r LONG_BINPUT
                put(u4(mv, pos)[0])
                pos += 4
            elif op in _LEN4 or op in _LEN4_SIGNED or op in _LEN8:
                ln, pos = length(pos, 4 if op not in _LEN8 else 8, signed=op in _LEN4_SIGNED)
                append(1 + ln // 8)
            elif op == 0x93:  # STACK_GLOBAL: module name -> a global
                pop(), pop()
                append(1)
            elif op == 0x92:  # NEWOBJ_EX: cls args kwargs -> a new object
                x, y = pop(), pop()
                pop()
                add = weigh([x, y])
                work += add
                if work > limit:
                    raise over()
                append([1 + add, 0])
            elif op == 0x6F:  # o OBJ: MARK cls args... OBJ
                items = to_mark()
                fence = marks[-1] if marks else 0
                if not items:
                    raise bad("OBJ without a class")
                add = weigh(items)
                work += add
                if work > limit:
                    raise over()
                append([1 + add, 0])
            elif op == 0x51:  # Q BINPERSID: pid -> what persistent_load gives
                x = pop()
                append(1 + (x if x.__class__ is int else x[0]))
            elif op == 0x32:  # 2 DUP
                x = top()
                if x.__class__ is not int:
                    x[1] = 1
                append(x)
            elif op == 0x30:  # 0 POP (a MARK on top is popped instead, as the C unpickler does)
                if marks and marks[-1] == len(stack):
                    marks.pop()
                    fence = marks[-1] if marks else 0
                else:
                    pop()
            elif op == 0x31:  # 1 POP_MARK
                to_mark()
                fence = marks[-1] if marks else 0
            elif op == 0x80:  # PROTO
                pos += 1
            elif op == 0x95:  # FRAME: the framed opcodes follow inline
                length(pos, 8)
                pos += 8
            elif op == 0x2E:  # . STOP
                x = pop()
                total = work + (x if x.__class__ is int else x[0])
                if total > limit:
                    raise over()
                return total
            elif op in _TEXT_OPS:  # protocol-0 opcodes: the argument is a line of text
                spec = _TEXT_OPS[op]
                text = text or io.BytesIO(mv)
                text.seek(pos)
                try:
                    arg = spec.arg.reader(text)
                except ValueError as exc:
                    raise bad(f"bad {spec.name} argument ({str(exc)[:80]})") from None
                size = text.tell() - pos
                pos += size
                if spec.name in ("PUT", "GET"):
                    if not isinstance(arg, int) or isinstance(arg, bool):
                        raise bad(f"bad {spec.name} index")
                    put(arg) if spec.name == "PUT" else get(arg)
                elif spec.name == "INST":  # MARK args... INST module name -> a new object
                    add = weigh(to_mark())
                    fence = marks[-1] if marks else 0
                    work += add
                    if work > limit:
                        raise over()
                    append([1 + add, 0])
                else:  # INT, LONG, FLOAT, STRING, UNICODE, GLOBAL, PERSID
                    append(1 + size // 8)
            else:
                raise bad(_unused_opcode(op))
    except (IndexError, struct.error):
        raise PickleTooCostly(f"the pickle ends without STOP (at byte {min(pos, n)})") from None


def check_cost(data: bytes, *, where: str, what: str) -> int:
    """`pickle_cost` of ``data`` within `pickle_budget`, or `BadInput` naming the file (exit 2)."""
    limit = pickle_budget(len(data))
    try:
        return pickle_cost(data, limit=limit)
    except PickleSelfReference as exc:
        # A cycle, not a cost: the unpickler would build it, and whatever walks the result (the metadata
        # decoder, hashing a record, repr in an error) would recurse or loop on it.
        raise BadInput(
            f"refusing {what}: it changes a list, dict or record after taking a second reference to it (a memo "
            f"fetch or DUP: {exc}), the only way a pickle builds one that contains itself; DCP and torch.save "
            f"never write that",
            where=where,
            hint="The file is forged or corrupt; restore it from its writer or use another checkpoint.",
        ) from None
    except PickleMemoFault as exc:
        # Not a cost either: a fetch of nothing, or of another object than the one a pickler put there.
        raise BadInput(
            f"refusing {what}: it misuses the pickle memo: {exc}. A pickler sets each memo index once, as it "
            "builds the object, and fetches only indices it has set; DCP and torch.save never write this",
            where=where,
            hint="The file is forged or corrupt; restore it from its writer or use another checkpoint.",
        ) from None
    except PickleTooCostly as exc:
        if str(exc).startswith(CUT_SHORT):  # not a cost: the bytes end before the pickle does
            raise BadInput(
                f"refusing {what}: {exc}: the file ({len(data)} bytes) ends before the pickle it starts does",
                where=where,
                hint="The file is truncated (an interrupted write or copy); restore it from its writer or use "
                     "another checkpoint.",
            ) from None
        raise BadInput(
            f"refusing {what}: {exc}. A pickle of {len(data)} bytes may build at most {COST_PER_BYTE} units per byte "
            f"plus {COST_SLACK} ({limit}), and DCP's own build under 2 per byte",
            where=where,
            hint="The file is forged or corrupt (a pickle built to exhaust memory); restore it from its writer "
                 "or use another checkpoint.",
        ) from None
