"""Edge values of the sampling fields, shared by the tests of every entry point (Session, CLI run, the OpenAI
server, Triton): what each must do with them.

``GREEDY``: accepted and decodes exactly the greedy text (a temperature under 1e-5, a top_p or top_k that keeps
one token); ``SAMPLED``: accepted and sampled (any text, no error); ``REFUSED``: a 4xx / RequestError naming the
field. Values are Python floats/ints; JSON bodies carry them as written by ``json.dumps`` (NaN, Infinity).
"""

from __future__ import annotations

GREEDY, SAMPLED, REFUSED = "greedy", "sampled", "refused"

EDGES: list[tuple[str, float | int, str]] = [
    ("temperature", 1e-320, GREEDY),  # a subnormal double: float32 logits / T were inf, then NaN probabilities
    ("temperature", 1e-300, GREEDY),
    ("temperature", 1e-6, GREEDY),
    ("temperature", 0.0, GREEDY),
    ("temperature", -0.0, GREEDY),
    ("temperature", 1e-5, SAMPLED),
    ("temperature", 1.0, SAMPLED),
    ("temperature", 1e300, SAMPLED),  # uniform over the vocabulary
    ("temperature", float("nan"), REFUSED),
    ("temperature", float("inf"), REFUSED),
    ("temperature", float("-inf"), REFUSED),
    ("temperature", -1e-300, REFUSED),
    ("temperature", -1.0, REFUSED),
    ("top_p", 1e-300, GREEDY),  # rounds to 0.0 in float32: every token was dropped, then 0/0
    ("top_p", 1e-45, GREEDY),
    ("top_p", 1.0, SAMPLED),
    ("top_p", 0.5, SAMPLED),
    ("top_p", 0.0, REFUSED),
    ("top_p", -0.0, REFUSED),
    ("top_p", 1.0000001, REFUSED),
    ("top_p", float("nan"), REFUSED),
    ("top_p", float("inf"), REFUSED),
    ("top_p", -0.5, REFUSED),
    ("top_k", 1, GREEDY),
    ("top_k", 0, SAMPLED),
    ("top_k", 2, SAMPLED),
    ("top_k", 2**31 - 1, SAMPLED),
    ("top_k", -1, REFUSED),
]
"""(field, value, outcome); the other sampling fields are temperature 1 (for top_p/top_k rows), top_p 1, top_k 0."""


def fields(name: str, value: float | int) -> dict[str, float | int]:
    """The sampling fields of one row: ``value`` for ``name``, temperature 1 when the row is not about it."""
    return {"temperature": 1.0, name: value} if name != "temperature" else {name: value}


def row_id(row: tuple[str, float | int, str]) -> str:
    return f"{row[0]}={row[1]!r}"
