"""The type of free JSON data, for the few fields that truly are free JSON.

Why a name of its own: a field typed ``dict[str, Any]`` says nothing and lets anything in (a
tensor, a path, a dataclass that `json.dumps` then refuses at the end of a long run); a field
typed `JsonDict` says the value is what a report or plan prints as it is, and nothing more.
Fields whose keys are known are `TypedDict`s instead (`reshard.model.plan_sections`).
"""
from __future__ import annotations

from typing import ForwardRef, Union

_SELF = ForwardRef("Json", module=__name__)  # resolved here, whichever module's hints name a JsonDict
Json = Union[None, bool, int, float, str, list[_SELF], dict[str, _SELF]]
"""A JSON value: what `json.dumps` writes without a ``default``."""

JsonDict = dict[str, Json]
"""A JSON object: a report section or a plan section whose keys are open."""

__all__ = ["Json", "JsonDict"]
