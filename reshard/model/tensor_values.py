"""A small tensor value made without torch: a numpy array tagged with the torch dtype it stands for.

Why: the values a plan makes itself (`reshard.model.plan.Plan.new_values`: each reseeded rank's
RNG state, `reshard.semantics.rng.seeded_state`) were torch tensors, so every conversion that
changed the world size imported torch (1.7 s of CPU on a quiet 2-core machine, far more when it is
loaded) to build a few kilobytes. An `ArrayTensor` holds the same elements as a C-contiguous
numpy array whose bytes are the tensor's storage bytes, and the `DType` of the tensor it stands for:
the checkpoint writer (`reshard.storage.checkpoints.dcp_writer.DcpWriter.write_chunk`) writes it as
the item ``torch.save`` writes for that tensor, byte for byte, with no torch import; verification
compares it by its bytes (`reshard.verification.objects`). Code that really needs a tensor (an
output format written through torch) asks `to_torch`, which imports torch then.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.model.dtypes import DType

__all__ = ["ArrayTensor", "is_tensor_value", "as_torch"]


@dataclass(frozen=True, eq=False)
class ArrayTensor:
    """``array``'s bytes (row-major, little-endian) are the storage of a ``dtype`` tensor of ``array.shape``.

    The array's itemsize must be ``dtype.itemsize`` (its numpy dtype only says how to read the bytes:
    an ``int64`` tensor is held as ``<i8``, a ``uint8`` one as ``u1``). The array is copied into a
    read-only C-contiguous one at construction, so a value a plan holds cannot change under it."""

    dtype: DType
    array: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"an ArrayTensor's dtype is a DType, not {type(self.dtype).__name__}")
        a = np.array(self.array, order="C", copy=True)  # small values: the copy is cheap, and the value is its own
        if a.dtype.itemsize != self.dtype.itemsize or a.dtype.byteorder == ">" or a.dtype.hasobject:
            raise ValueError(f"a {a.dtype} array cannot hold the bytes of a {self.dtype} tensor")
        a.flags.writeable = False
        object.__setattr__(self, "array", a)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.array.shape)

    def dim(self) -> int:
        return self.array.ndim

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def data(self) -> memoryview:
        """The storage bytes, without a copy."""
        return memoryview(self.array).cast("B") if self.array.size else memoryview(b"")

    def tolist(self) -> Any:
        return self.array.tolist()

    def to_torch(self) -> Any:
        """The ``torch.Tensor`` this stands for (imports torch: only code that needs a tensor asks)."""
        import torch

        flat = torch.frombuffer(bytearray(self.array.tobytes()), dtype=torch.uint8) if self.array.size \
            else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype.torch).reshape(self.shape)

    def __repr__(self) -> str:
        return f"ArrayTensor({self.dtype.name}{list(self.shape)})"


def is_tensor_value(value: Any) -> bool:
    """Whether ``value`` is a tensor a plan writes as a tensor item: a ``torch.Tensor`` or an
    `ArrayTensor` (asked without importing torch: no tensor exists before torch is imported)."""
    if isinstance(value, ArrayTensor):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def as_torch(value: Any) -> Any:
    """``value`` with every `ArrayTensor` in it (also inside dicts, lists and tuples) made a ``torch.Tensor``,
    for code that hands values to torch; anything else as it is."""
    if isinstance(value, ArrayTensor):
        return value.to_torch()
    if isinstance(value, dict) and any(_holds(v) for v in value.values()):
        return type(value)((k, as_torch(v)) for k, v in value.items())
    if type(value) in (list, tuple) and any(_holds(v) for v in value):
        return type(value)(as_torch(v) for v in value)
    return value


def _holds(value: Any) -> bool:
    if isinstance(value, ArrayTensor):
        return True
    if isinstance(value, dict):
        return any(_holds(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v) for v in value)
    return False
