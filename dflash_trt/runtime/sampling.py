"""Logits -> probabilities transform and seeded draws (docs/algorithm.md §3.4, docs/reference-parity.md §3.3).

Everything is float32: divide by T, optional top-k, softmax, optional top-p (keep entries whose
cumulative mass *before* them is ``< top_p``), renormalise, scatter back to the vocabulary.
Draws use the request's own ``torch.Generator`` so a seed reproduces a request whatever else runs.

Edges, as vLLM handles them: a temperature below ``GREEDY_BELOW`` (1e-5) is greedy (dividing float32 logits by
1e-300 gives inf, and softmax of inf is NaN); the most likely token always survives top-p and top-k, so a
``top_p`` that rounds to 0 in float32 (1e-300) keeps exactly that token. For every valid setting the result is
a distribution (finite, non-negative, rows summing to 1); at T >= 1e-5 with a ``top_p`` that keeps the top token
(every ``top_p`` >= 1.2e-38, float32's smallest normal) it is exactly the softmax described above.
"""

from __future__ import annotations

import torch
from torch import Tensor

GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``)."""


def is_greedy(temperature: float) -> bool:
    """Whether a request at ``temperature`` decodes greedily (argmax, greedy verification): T < 1e-5, 0 and -0.0
    included."""
    return temperature < GREEDY_BELOW


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Shapes: logits ``[..., V]`` -> probabilities ``[..., V]`` (float32, rows sum to 1). A greedy temperature
    (:func:`is_greedy`) gives the one-hot distribution of the argmax: the limit of the softmax as T -> 0."""
    if is_greedy(temperature):
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, argmax_rows(logits).unsqueeze(-1), 1.0)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        # exactly k survivors (ties at the k-th value broken by topk's order, as the reference does)
        values, indices = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, indices, values)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        dropped = mass_before >= top_p
        dropped[..., 0] = False  # the most likely token stays whatever top_p is (its mass before is 0 >= 0.0f)
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


def argmax_rows(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)``: the first maximum on ties and a NaN counted as the maximum, as torch does. A CPU tensor
    goes through numpy (a view of the same memory, no copy): torch's CPU argmax is an unvectorised reduction, ~620 us
    on a step's ``[256, 512]`` logits against ~40 us for numpy's (single thread, this repository's 2-core machine).
    On a GPU it is torch's, on the device. Shapes: ``[..., V]`` -> int64 ``[...]``."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(logits.detach().numpy().argmax(-1))
    return logits.argmax(-1)


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One draw per row by inversion: the first token whose cumulative mass exceeds ``u · mass`` (``mass`` = the
    row's sum, so rows need not be normalised). Token ``v`` is drawn with probability ``p_v / mass`` (float32
    cumulative sums: a token below ~1e-7 of its row's mass may be absorbed and never drawn) and a zero-probability
    token never, its interval being empty. The uniforms come from the request's own generator (:func:`uniforms`),
    so a draw depends on nothing else in the batch; it runs on the device, without reading anything back. A row that
    is not a distribution (NaN, no mass) still gives an id in range; callers check :func:`has_mass`.
    Shapes: probs ``[R, V]``, uniforms ``[R]`` in ``[0, 1)`` -> ids ``[R]`` int64.
    """
    cdf = probs.float().cumsum(-1)
    mass = cdf[:, -1:]
    # u · mass can round up to mass itself; the largest float below it keeps the draw inside the row
    target = torch.minimum(uniforms.unsqueeze(1) * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def has_mass(probs: Tensor) -> Tensor:
    """Rows that are distributions up to scale: finite, with positive mass. Shapes: ``[R, V]`` -> bool ``[R]``."""
    mass = probs.sum(-1)
    return torch.isfinite(mass) & (mass > 0)


def uniforms(generator: torch.Generator, count: int) -> Tensor:
    """``count`` uniforms in ``[0, 1)`` from one request's generator, on its device. Shapes: -> ``[count]``."""
    return torch.rand(count, generator=generator, device=generator.device)
