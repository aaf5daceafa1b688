"""Kubernetes label selectors, checked client-side: the API server filters by ``labelSelector``, and
the watcher checks every slice again, so what it follows never depends on a server or proxy honoring
the selector. kubernetes_asyncio sends selectors as text and has no matcher: this one is the API's
grammar (``a=b,c!=d,e in (f,g),h notin (i),j,!k``) with the API server's semantics."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_EQUALITY = re.compile(rf"({_KEY})\s*(==|=|!=)\s*({_VALUE})")
_SET = re.compile(rf"({_KEY})\s+(in|notin)\s*\(([^()]*)\)")
_EXISTS = re.compile(rf"(!?)\s*({_KEY})")
LABEL_KEY = re.compile(  # [DNS subdomain prefix/]name, as the API server checks label keys
    r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
LABEL_VALUE = re.compile(_VALUE)


@dataclass(frozen=True)
class LabelSelector:
    """A parsed selector: ``(key, op, values)`` requirements, all of which must hold."""

    text: str
    requirements: tuple[tuple[str, str, frozenset[str]], ...]

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        """Raises ValueError naming the term it cannot read (the config reports it at its key)."""
        reqs: list[tuple[str, str, frozenset[str]]] = []
        for term in _terms(text):
            if m := _EQUALITY.fullmatch(term):
                reqs.append((m[1], "!=" if m[2] == "!=" else "=", frozenset((m[3],))))
            elif m := _SET.fullmatch(term):
                values = [v.strip() for v in m[3].split(",")]
                if not all(values) or not all(LABEL_VALUE.fullmatch(v) for v in values):
                    raise ValueError(f"label selector {text!r}: bad values in {term!r}")
                reqs.append((m[1], m[2], frozenset(values)))
            elif m := _EXISTS.fullmatch(term):
                reqs.append((m[2], "!" if m[1] else "exists", frozenset()))
            else:
                raise ValueError(f"label selector {text!r}: cannot read {term!r}")
        return cls(text, tuple(reqs))

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, op, values in self.requirements:
            have = labels.get(key)
            if op in ("=", "in"):
                ok = have is not None and have in values
            elif op in ("!=", "notin"):
                ok = have is None or have not in values
            else:
                ok = (have is not None) == (op == "exists")
            if not ok:
                return False
        return True


def _terms(text: str) -> list[str]:
    """The selector's comma-separated terms (commas inside ``in (...)`` belong to the term)."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(text[start:i].strip())
            start = i + 1
    terms.append(text[start:].strip())
    if depth or (text.strip() and not all(terms)):
        raise ValueError(f"label selector {text!r}: empty term or unbalanced parentheses")
    return [t for t in terms if t]


def labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    """An API object's labels (as JSON: ``metadata.labels``)."""
    return (obj.get("metadata") or {}).get("labels") or {}
