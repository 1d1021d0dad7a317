"""Tensor element types as plain data: a name, a size, a kind. No torch.

Why not ``torch.dtype``: reading `.metadata`, planning a layout and linking files touch no
tensor, yet importing torch costs 1.4 s on a quiet 2-core machine and over 20 s on a loaded
one (``torch._meta_registrations`` and ``torch._decomp`` alone are a third of it). Every record
of the model (`reshard.model.checkpoint.Entry`) holds a `DType`; the code that decodes or
encodes tensor bytes asks for `DType.torch`, which imports torch then, once.

The table mirrors torch 2.13's own dtypes by their attribute names (``tests/test_dtypes.py``
checks it against ``vars(torch)``: every dtype, its itemsize, float/complex, its aliases).
A pickle names a dtype as the global ``torch.<name>``; only names in this table are admitted
(`reshard.storage.pickles.safe_pickle`), so no name taken from a file is ever looked up on ``torch``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["DType", "DTYPES", "dtype_named", "from_torch", "lookup", "is_torch_tensor", "torch_dtype", "unstorable_reason"]


@dataclass(frozen=True, slots=True, eq=False)
class DType:
    """One element type: ``name`` is torch's attribute name (``bfloat16``), ``itemsize`` its bytes.

    ``kind`` is one of ``float``, ``int``, ``uint``, ``bool``, ``complex``, ``quantized``
    (items carry a quantizer beside the bytes), ``bits`` (opaque bytes) and ``subbyte``
    (``int1``..``uint7``: names without a storage, which ``torch.save`` refuses).
    ``str()`` is torch's (``torch.bfloat16``), so messages read as they did with torch dtypes.
    A `DType` equals the ``torch.dtype`` of its name (``torch.float32 == DType("float32", ...)``
    in either order), so a comparison with a tensor's dtype means what it says; as a dict key it
    hashes as its name, so tables keyed by `DType` are looked up with a `DType`.
    """

    name: str
    itemsize: int
    kind: str

    def __str__(self) -> str:
        return f"torch.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self.name == other.name
        torch = sys.modules.get("torch")  # no torch.dtype exists before torch is imported
        if torch is not None and isinstance(other, torch.dtype):
            return str(other) == f"torch.{self.name}"
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> tuple:
        return (dtype_named, (self.name,))  # the shared table entry, never a copy of its fields

    def __setstate__(self, state: Any) -> None:
        raise TypeError("a DType is immutable")  # a pickle's BUILD must not rewrite a shared table entry

    __repr__ = __str__

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "float"

    @property
    def is_complex(self) -> bool:
        return self.kind == "complex"

    @property
    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch: only code that touches tensor bytes asks)."""
        import torch

        return getattr(torch, self.name)  # a name from this table only, never from a file


_TABLE: tuple[tuple[str, int, str, tuple[str, ...]], ...] = (
    # name, itemsize, kind, aliases torch also binds
    ("bool", 1, "bool", ()),
    ("uint8", 1, "uint", ()), ("uint16", 2, "uint", ()), ("uint32", 4, "uint", ()), ("uint64", 8, "uint", ()),
    ("int8", 1, "int", ()), ("int16", 2, "int", ("short",)), ("int32", 4, "int", ("int",)),
    ("int64", 8, "int", ("long",)),
    ("float16", 2, "float", ("half",)), ("bfloat16", 2, "float", ()), ("float32", 4, "float", ("float",)),
    ("float64", 8, "float", ("double",)),
    ("float8_e5m2", 1, "float", ()), ("float8_e4m3fn", 1, "float", ()), ("float8_e5m2fnuz", 1, "float", ()),
    ("float8_e4m3fnuz", 1, "float", ()), ("float8_e8m0fnu", 1, "float", ()), ("float4_e2m1fn_x2", 1, "float", ()),
    ("complex32", 4, "complex", ("chalf",)), ("complex64", 8, "complex", ("cfloat",)),
    ("complex128", 16, "complex", ("cdouble",)),
    ("qint8", 1, "quantized", ()), ("quint8", 1, "quantized", ()), ("qint32", 4, "quantized", ()),
    ("quint4x2", 1, "quantized", ()), ("quint2x4", 1, "quantized", ()),
    ("bits1x8", 1, "bits", ()), ("bits2x4", 1, "bits", ()), ("bits4x2", 1, "bits", ()), ("bits8", 1, "bits", ()),
    ("bits16", 2, "bits", ()),
    ("uint1", 1, "subbyte", ("bit",)), ("uint2", 1, "subbyte", ()), ("uint3", 1, "subbyte", ()),
    ("uint4", 1, "subbyte", ()), ("uint5", 1, "subbyte", ()), ("uint6", 1, "subbyte", ()), ("uint7", 1, "subbyte", ()),
    ("int1", 1, "subbyte", ()), ("int2", 1, "subbyte", ()), ("int3", 1, "subbyte", ()), ("int4", 1, "subbyte", ()),
    ("int5", 1, "subbyte", ()), ("int6", 1, "subbyte", ()), ("int7", 1, "subbyte", ()),
)

DTYPES: dict[str, DType] = {}
"""Every dtype by every name torch binds it to (``float`` and ``float32`` give the same `DType`)."""
for _name, _size, _kind, _aliases in _TABLE:
    DTYPES[_name] = DTYPES.get(_name) or DType(_name, _size, _kind)
    for _alias in _aliases:
        DTYPES[_alias] = DTYPES[_name]
del _name, _size, _kind, _aliases


def lookup(name: str) -> DType | None:
    """The dtype torch binds to ``name`` (``bfloat16``, ``torch.bfloat16``, ``half``), or None."""
    return DTYPES.get(name.removeprefix("torch."))


def dtype_named(name: str) -> DType:
    """`lookup`, raising ``ValueError`` for a name torch does not define."""
    found = lookup(name)
    if found is None:
        raise ValueError(f"'{name}' is not a torch dtype")
    return found


def from_torch(dtype: Any) -> DType:
    """The `DType` of a ``torch.dtype`` (or a `DType`, returned as it is)."""
    if isinstance(dtype, DType):
        return dtype
    return dtype_named(str(dtype))


def torch_dtype(dtype: Any) -> Any:
    """The ``torch.dtype`` of a `DType` (a ``torch.dtype`` passes through): where bytes meet torch."""
    return dtype.torch if isinstance(dtype, DType) else dtype


def unstorable_reason(dtype: DType) -> str | None:
    """Why no item of ``dtype`` is plain storage bytes that reshard can cut and join (None: it is).

    Every dtype with a storage of whole bytes is (float8, float4, uint16-64, bits and complex
    included). Quantized items carry their quantizer; the sub-byte names have no storage.
    """
    if dtype.kind == "quantized":
        return ("a quantized dtype: its items hold the quantizer (scale, zero point) beside the bytes, "
                "so its chunks cannot be cut or joined as plain storage")
    if dtype.kind == "subbyte":
        return "a dtype without a storage of whole bytes (torch.save itself cannot write it)"
    return None


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor``, asked without importing torch: no tensor can
    exist before torch is imported, so an unimported torch means no."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
