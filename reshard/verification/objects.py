"""Objects compared without executing them: bit for bit, by the rule tensors are.

An object item (a step counter, a scheduler's state, a data loader's position, an opaque
blob), as the safe reader loaded it, is compared by its structure, exact types and bits,
never by running code the checkpoint names (`object_difference`: the first difference as a
line; `identical`: none). `reshard.verification.checkpoints` compares object keys this way
and `reshard.verification.evidence` checks a re-derived value against the output's with it.
Also the short ``repr`` every difference quotes (`short_repr`), the raw-bits view of a
tensor that the value comparison uses (`bits`: an integer view of the element's width, so
float8, float4, uint16-64, bits and complex compare by their bytes, NaN payloads and
``-0.0`` included, whatever arithmetic their dtype lacks on CPU), a differing element as a
value (`element`) and the widened copy a tolerance compares (`widened`).
"""
from __future__ import annotations

import io
import reprlib
import struct
from typing import TYPE_CHECKING, Any

from reshard.errors import BadInput
from reshard.model.dtypes import is_torch_tensor
from reshard.model.tensor_values import ArrayTensor

if TYPE_CHECKING:  # torch is imported by the functions that get tensors, never by importing this module
    import torch

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 6


def short_repr(x: Any) -> str:
    if is_torch_tensor(x) or isinstance(x, ArrayTensor):
        return f"tensor({str(x.dtype).removeprefix('torch.')}{list(x.shape)})"
    return _repr.repr(x)


def bits(t: "torch.Tensor") -> "torch.Tensor":
    """A 2-D integer view ``[numel, words]`` of the raw bytes of ``t`` (contiguous)."""
    import torch

    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype == torch.bool:  # viewed before any copy: torch's bool copy turns every non-zero byte into 0x01
        return t.view(torch.uint8).contiguous().reshape(-1, 1)
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    if size in by_size:
        return flat.view(by_size[size]).reshape(-1, 1)
    return flat.view(torch.uint8).reshape(-1, size)


def element(t: "torch.Tensor", flat: int) -> Any:
    """Element ``flat`` of ``t`` as a Python value for a difference report: its number when the
    dtype has arithmetic on CPU (float8 through float64), else its raw bits as hex (``0x7f``:
    float4_e2m1fn_x2 and the bits dtypes have neither ``.item()`` nor a conversion); a NaN with
    its bits (``nan (0x7f)``), since two NaNs that differ differ only there; a bool as False or
    True, or as its byte (``0x02``) when it is neither, since ``.item()`` would call it True."""
    import torch

    v = (t.view(torch.uint8) if t.dtype == torch.bool else t).reshape(-1)[flat]  # a bool's byte as stored
    hexbits = "0x" + bytes(v.reshape(1).contiguous().view(torch.uint8).tolist()[::-1]).hex()  # little-endian
    if t.dtype == torch.bool:  # False, True, or (a byte no bool operation writes) its bits: 0x02 is not True
        byte = int(v.item())
        return bool(byte) if byte <= 1 else hexbits
    try:
        x = v.item()
    except (RuntimeError, TypeError):
        try:
            x = float(v.to(torch.float64).item())
        except (RuntimeError, TypeError):
            return hexbits
    if isinstance(x, float) and x != x:
        return f"nan ({hexbits})"
    return x


def widened(t: "torch.Tensor") -> "torch.Tensor | None":
    """``t`` as float64 (complex128 when complex) for a comparison within a tolerance, or None for
    a dtype that has no numeric conversion on CPU (float4_e2m1fn_x2, the bits dtypes): such
    elements can only be compared by their bits."""
    import torch

    try:
        return t.to(torch.complex128 if t.is_complex() else torch.float64)
    except (RuntimeError, TypeError):
        return None


MAX_OBJECT_DEPTH = 200  # nesting beyond this is bad input (a self-referencing pickle must not recurse forever)


def _float_bits(v: float | complex) -> bytes:
    """The IEEE bits of a float (both parts of a complex): -0.0 and 0.0 differ, NaN payloads count."""
    if isinstance(v, complex):
        return struct.pack("<dd", v.real, v.imag)
    return struct.pack("<d", v)


def _key_token(k: Any) -> Any:
    """A hashable stand-in for a dict key or set element that is equal only for identical values.

    Python's own equality would let ``{1: x}`` match ``{1.0: x}`` and ``{0.0: x}`` match
    ``{-0.0: x}``; the token carries the exact type and, for floats, the bits.
    """
    if isinstance(k, (float, complex)):
        return (type(k), _float_bits(k))
    if isinstance(k, (tuple, frozenset)):
        inner = tuple(_key_token(e) for e in k)
        return (type(k), inner if isinstance(k, tuple) else frozenset(inner))
    return (type(k), k)


def _tensor_same(x: "torch.Tensor", y: "torch.Tensor") -> bool:
    """Same layout, shape, dtype and bits (the rule `verify` applies to tensor entries)."""
    import torch

    if x.layout != y.layout or x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.layout != torch.strided:
        x, y = x.to_dense(), y.to_dense()
    x, y = x.resolve_conj().resolve_neg(), y.resolve_conj().resolve_neg()
    return bool(torch.equal(bits(x), bits(y)))


def blob_difference(x: io.BytesIO, y: io.BytesIO, where: str) -> str | None:
    """Two ``io.BytesIO`` blobs compared by their contents, then their position; None when the same."""
    import numpy as np

    bx, by = x.getvalue(), y.getvalue()
    if len(bx) != len(by):
        return f"{where}: BytesIO of {len(bx):,} bytes in A, {len(by):,} bytes in B"
    if bx != by:
        first = int(np.flatnonzero(np.frombuffer(bx, np.uint8) != np.frombuffer(by, np.uint8))[0])
        return f"{where}: BytesIO contents differ (first at byte {first:,})"
    if x.tell() != y.tell():
        return f"{where}: BytesIO position {x.tell()} in A, {y.tell()} in B"
    return None


def object_difference(x: Any, y: Any, path: str = "", _depth: int = 0) -> str | None:
    """The first difference between two objects, bit for bit, as a short line; None when identical.

    Objects are compared by the rule tensors are (`verify` is bitwise unless told otherwise),
    applied to everything an object item can hold:

    * **types exactly**: ``1`` and ``1.0`` differ, ``True`` and ``1`` differ, a list is not a tuple;
    * **floats by their bits** (complex numbers: both parts): ``-0.0 != 0.0``, and two NaNs are
      equal only when their payloads are (``nan == nan`` bit for bit is the same value);
    * **tensors** by layout, shape, dtype and bits (NaN-safe, ``-0.0 != 0.0``), an `ArrayTensor` (a value
      a plan made without torch) as the tensor it stands for; numpy arrays and
      scalars by dtype, shape and bytes (object arrays element by element);
    * **dicts** by their keys (each key by the same rule, so ``{0.0: v}`` is not ``{-0.0: v}``;
      insertion order is not compared) and then values recursively; **lists and tuples** by
      length and element; **sets** by their elements' exact forms;
    * ``str``, ``bytes``, ``int``, ``bool``, ``None`` by ``==`` once the types match;
    * **blobs** (``io.BytesIO``, which a trainer hands to DCP for opaque state) by their bytes
      (``getvalue()``) and then their read position: a BytesIO has no value equality of its
      own (``==`` is identity, so two loads of one item would always "differ");
    * anything else (the safe loader's inert stand-ins): ``==`` when it answers a bool, else
      the ``repr``.

    Nesting deeper than ``MAX_OBJECT_DEPTH`` is `BadInput` (exit 2) rather than a recursion error.
    """
    import numpy as np

    where = path or "value"
    if _depth > MAX_OBJECT_DEPTH:
        raise BadInput(f"an object is nested more than {MAX_OBJECT_DEPTH} levels deep at {where}",
                       hint="No trainer state nests this deep; the object item is malformed or self-referencing.")
    if isinstance(x, ArrayTensor) or isinstance(y, ArrayTensor):  # a value made without torch (a reseeded RNG state)
        if isinstance(x, ArrayTensor) and isinstance(y, ArrayTensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"
            return None if bytes(x.data()) == bytes(y.data()) else f"{where}: tensor values differ (bitwise)"
        # against a torch tensor (torch is imported then): as the tensor it stands for
        x = x.to_torch() if isinstance(x, ArrayTensor) and is_torch_tensor(y) else x
        y = y.to_torch() if isinstance(y, ArrayTensor) and is_torch_tensor(x) else y
    if type(x) is not type(y):
        return f"{where}: {type(x).__name__} {short_repr(x)} in A, {type(y).__name__} {short_repr(y)} in B"
    if isinstance(x, dict):
        tx, ty = {_key_token(k): k for k in x}, {_key_token(k): k for k in y}
        if set(tx) != set(ty):
            only_a = [k for t, k in tx.items() if t not in ty]
            only_b = [k for t, k in ty.items() if t not in tx]
            return f"{where}: keys only in A {short_repr(only_a)}, only in B {short_repr(only_b)}"
        for t, k in tx.items():
            d = object_difference(x[k], y[ty[t]], f"{path}[{k!r}]", _depth + 1)
            if d:
                return d
        return None
    if isinstance(x, (list, tuple)):
        if len(x) != len(y):
            return f"{where}: length {len(x)} in A, {len(y)} in B"
        for i, (u, v) in enumerate(zip(x, y)):
            d = object_difference(u, v, f"{path}[{i}]", _depth + 1)
            if d:
                return d
        return None
    if isinstance(x, (set, frozenset)):
        same = {_key_token(e) for e in x} == {_key_token(e) for e in y}
        return None if same else f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"
    if is_torch_tensor(x):
        if x.layout != y.layout or x.shape != y.shape or x.dtype != y.dtype:
            return f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"
        return None if _tensor_same(x, y) else f"{where}: tensor values differ (bitwise)"
    if isinstance(x, (float, complex)):
        return None if _float_bits(x) == _float_bits(y) else f"{where}: {x!r} in A, {y!r} in B"
    if isinstance(x, np.ndarray):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{where}: array {x.dtype}{list(x.shape)} in A, {y.dtype}{list(y.shape)} in B"
        if x.dtype.hasobject:
            return object_difference(x.tolist(), y.tolist(), path, _depth + 1)
        return None if x.tobytes() == y.tobytes() else f"{where}: array values differ (bitwise)"
    if isinstance(x, np.generic):
        return None if (x.dtype, x.tobytes()) == (y.dtype, y.tobytes()) else f"{where}: {x!r} in A, {y!r} in B"
    if isinstance(x, io.BytesIO):
        return blob_difference(x, y, where)
    try:
        res = x == y
        same = res if isinstance(res, bool) else repr(x) == repr(y)
    except Exception:  # noqa: BLE001 - objects whose == misbehaves: compare their repr
        same = repr(x) == repr(y)
    return None if same else f"{where}: {short_repr(x)} in A, {short_repr(y)} in B"


def identical(x: Any, y: Any) -> bool:
    """True when ``x`` and ``y`` are the same value bit for bit (see `object_difference`)."""
    return object_difference(x, y) is None
