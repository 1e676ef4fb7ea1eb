"""Temperature / top-p warping, shared by the base and every drafter.

Rejection sampling is lossless only if the target p and the draft q are warped the same way, so there
is exactly one `warp` and everything (acceptance, drafters that sample, the AR baseline) calls it.
All randomness goes through an explicit `torch.Generator` so a run is reproducible from its seed.
"""

from __future__ import annotations

import torch


def check_sampling_params(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}; use 1.0 to disable nucleus sampling")


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> warped fp32 logits [..., V] (tokens outside the nucleus set to -inf).

    temperature must be > 0 here (greedy has no distribution to warp; see `warped_probs`).
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token).
    """
    check_sampling_params(temperature, top_p)
    if temperature == 0:
        raise ValueError("warp() needs temperature > 0; call warped_probs(), which maps T=0 to a one-hot "
                         "argmax")
    x = logits.float() / temperature
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(dim=-1)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p  # the top token has mass_before 0, so it always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def warped_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] fp32. T == 0 gives the one-hot of the argmax (the
    T -> 0 limit), so greedy is a special case of every sampling rule built on this."""
    check_sampling_params(temperature, top_p)
    if temperature == 0:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    return warp(logits, temperature, top_p).softmax(dim=-1)


def uniform(generator: torch.Generator | None, device: torch.device | str = "cpu") -> float:
    """One U[0, 1) draw from `generator` (drawn on the generator's own device)."""
    dev = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=dev))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V] (need not be normalised, must have positive mass)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs.float(), 1, generator=generator))
