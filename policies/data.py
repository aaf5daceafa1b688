"""Per-request data: an open, typed slot on the request context (``RequestContext.data``).

A policy (or the gateway) publishes a value under a ``Key`` and any policy that imports the key
reads it, without a field on ``RequestContext`` or ``EndpointView`` and without a change to the
gateway: llm-d's ``CycleState``, with keys that carry their value's type so mypy checks both ends.

    MATCHED = Key[int]("prefix.matched_blocks")   # once, at module level, next to its producer

    ctx.data.put(MATCHED, 12)                     # the producer (a ``publish`` hook, or any policy)
    blocks = ctx.data.get(MATCHED, 0)             # a reader: int (None without a default)

Values are published when the request is prepared (``Publisher.publish``, in ``policies/base.py``)
or while it is routed (a filter or scorer of the decode pool for the decider and the prefill pool,
which run after it; but a pool with one candidate skips its scorers); the lifecycle hooks see them
too. The slot is one per request: routing the
request again (a failover's next choice) reads and may overwrite the same values, and a migration's
continuation starts with an empty one.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast, overload

T = TypeVar("T")


class Key(Generic[T]):
    """The name of one kind of per-request data and, as its type argument, its value's type. Keys
    compare by identity: declare each once, as a module constant, and import it where it is read
    (the name is for messages and ``/debug/route``; two keys may not share one within a request)."""

    __slots__ = ("doc", "name")

    def __init__(self, name: str, doc: str = "") -> None:
        if not name:
            raise ValueError("a key needs a name")
        self.name = name
        self.doc = doc

    def __repr__(self) -> str:
        return f"Key({self.name!r})"


class RequestData:
    """The values published for one request, by key."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[str, tuple[Key[Any], Any]] = {}

    def put(self, key: Key[T], value: T) -> None:
        """Publish ``value`` under ``key`` (replacing what was there)."""
        held = self._values.get(key.name)
        if held is not None and held[0] is not key:
            raise KeyError(f"another key is named {key.name!r}: each key is declared once, and imported")
        self._values[key.name] = (key, value)

    @overload
    def get(self, key: Key[T]) -> T | None: ...

    @overload
    def get(self, key: Key[T], default: T) -> T: ...

    def get(self, key: Key[T], default: T | None = None) -> T | None:
        """The value published under ``key``, else ``default``."""
        held = self._values.get(key.name)
        if held is None or held[0] is not key:
            return default
        return cast(T, held[1])

    def __contains__(self, key: object) -> bool:
        held = self._values.get(key.name) if isinstance(key, Key) else None
        return held is not None and held[0] is key

    def names(self) -> list[str]:
        """The keys published, by name, in publishing order (for traces)."""
        return list(self._values)

    def __repr__(self) -> str:
        return f"RequestData({', '.join(self._values)})"
