"""The healing transfer's messages: a state's tensors as a few point-to-point messages.

Both sides make the same plan from the tensors' sizes (`messages_of`): a large tensor travels
in chunks of at most CHUNK_BYTES (views of it, no copy), the small ones together in bundles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CHUNK_BYTES", "messages_of"]

CHUNK_BYTES = 16 << 20  # the healing transfer's largest message


def messages_of(tensors: list[torch.Tensor], sending: bool) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """The messages that carry `tensors` (contiguous) between two groups, and, receiving, what
    puts the bundles' bytes into the small tensors once they arrived. A tensor of CHUNK_BYTES or
    more travels in chunks (views of it, no copy); the small ones (an optimizer's step counts,
    biases, the RNG state) travel together, their bytes packed into bundles of at most
    CHUNK_BYTES, so a state of many small tensors is a few messages, not one round trip each.
    Both sides make the same plan from the tensors' sizes."""
    messages: list[torch.Tensor] = []
    bundles: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    small: list[torch.Tensor] = []  # the next bundle's tensors, as bytes

    def close() -> None:
        if small:
            bundle = torch.cat(small) if sending else torch.empty(sum(r.numel() for r in small), dtype=torch.uint8)
            messages.append(bundle)
            bundles.append((bundle, list(small)))
            small.clear()

    pending = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes >= CHUNK_BYTES:
            messages += _chunks(t)
            continue
        if pending + nbytes > CHUNK_BYTES:
            close()
            pending = 0
        small.append(t.reshape(-1).view(torch.uint8))
        pending += nbytes
    close()

    def unbundle() -> None:
        for bundle, raw in bundles:
            offset = 0
            for r in raw:
                r.copy_(bundle[offset:offset + r.numel()])
                offset += r.numel()

    return messages, unbundle


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` (contiguous) as flat views of at most CHUNK_BYTES each."""
    flat = t.reshape(-1)
    step = max(1, CHUNK_BYTES // max(1, t.element_size()))
    return [flat[i:i + step] for i in range(0, flat.numel(), step)]
