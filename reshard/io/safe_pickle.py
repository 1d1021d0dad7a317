"""An allow-listing unpickler for DCP's `.metadata`.

Stock DCP reads `.metadata` with ``pickle.load``: a crafted file runs code the moment it is
opened (pytorch #189308). Here every global the pickle names is looked up in
``formats/dcp_metadata.toml`` and replaced by an inert stand-in; reshard never imports or
calls a class the pickle asks for. Anything not listed is refused before it is built.
"""
from __future__ import annotations

import io
import pickle
import tomllib
from functools import lru_cache
from typing import Any

from reshard.errors import BadInput, UnsafeInput
from reshard.paths import formats_root


class Record:
    """Inert stand-in for a DCP metadata dataclass: an attribute bag, nothing more."""

    _tuple_state: tuple[str, ...] = ()
    _key_fields: tuple[str, ...] = ()
    _qualname = "Record"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Record":
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        # Protocol-2 dataclasses give a dict; slotted classes give (dict, slots);
        # classes with a custom __getstate__ (TensorProperties) give a tuple.
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)) and isinstance(state[1], dict) and not self._tuple_state:
            for part in state:
                if part:
                    self.__dict__.update({str(k): v for k, v in part.items()})
        elif isinstance(state, dict):
            self.__dict__.update({str(k): v for k, v in state.items()})
        elif isinstance(state, tuple) and self._tuple_state:
            self.__dict__.update(dict(zip(self._tuple_state, state)))
        else:
            raise pickle.UnpicklingError(f"unexpected state for {self._qualname}: {type(state).__name__}")

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __hash__(self) -> int:
        return hash(tuple(_hashable(self.__dict__.get(f)) for f in self._key_fields))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        fields = self._key_fields or tuple(sorted(set(self.__dict__) | set(other.__dict__)))
        return all(_hashable(self.__dict__.get(f)) == _hashable(other.__dict__.get(f)) for f in fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{self._qualname}({inner})"


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(v)
    return v


def _size(*args: Any) -> tuple[int, ...]:
    if len(args) != 1 or not isinstance(args[0], (tuple, list)):
        raise pickle.UnpicklingError("torch.Size expects one tuple argument")
    vals = tuple(args[0])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise pickle.UnpicklingError("torch.Size holds non-integers")
    return vals


def _layout(name: Any) -> str:
    return str(name)


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
            cls = type(name, (Record,), {
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


def _dtype(name: str) -> Any:
    import torch

    value = getattr(torch, name, None)
    if isinstance(value, torch.dtype):
        return value
    return None


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves globals only through the allow list."""

    def __init__(self, file: io.BufferedIOBase, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        table = _allow_list()
        found = table.get((module, name))
        if found is None and table.get((module, "*")) == "dtype":
            found = _dtype(name)
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
    """Unpickle `.metadata` bytes safely; bad or hostile bytes become BadInput/UnsafeInput."""
    try:
        return MetadataUnpickler(io.BytesIO(data), where).load()
    except UnsafeInput:
        raise
    except RecursionError:
        raise BadInput("metadata pickle nests too deeply", where=where)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, UnicodeDecodeError, OverflowError, MemoryError, ImportError, struct_error()) as exc:
        raise BadInput(
            f"cannot parse the checkpoint metadata ({type(exc).__name__}: {exc})",
            where=where,
            hint="The file is truncated or corrupt; restore it from the writer or use another checkpoint.",
        ) from None


def struct_error() -> type[Exception]:
    import struct

    return struct.error
