"""
Collectives over the ranks of a run, for the losses that see every rank's batch ([`MMFusionPretrainingLoss`], told the
ranks it gathers from) and for the gradient cache of `mm_fusion.training`. Every function is a no-op in a single
process. Saved with a model's code, since its modeling file uses it.
"""

import torch
import torch.nn.functional as F


def world() -> tuple[int, int]:
    """World size and rank of the default process group; `(1, 0)` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def gather_sizes(x: torch.Tensor, dims: int = 1) -> list[tuple[int, ...]]:
    """Every rank's `x.shape[:dims]`, in rank order: the sizes to pass to [`all_gather_with_grad`] when they differ."""
    size, _ = world()
    shape = tuple(x.shape[:dims])
    if size == 1:
        return [shape]
    local = torch.tensor(shape, device=x.device)
    sizes = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(sizes, local)
    return [tuple(int(n) for n in s) for s in sizes]


def _pad_to(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Zero-pad `x` at the end of each dimension up to `shape`."""
    pads = []
    for size, target in zip(reversed(x.shape), reversed(shape)):
        pads += [0, target - size]
    return F.pad(x, pads) if any(pads) else x


def all_gather_with_grad(x: torch.Tensor, rows: list[int] | None = None, length: int | None = None) -> torch.Tensor:
    """
    Every rank's `x` concatenated along dim 0, in rank order. The gradient of each rank's rows flows back to that
    rank (`torch.distributed.nn`'s all-gather); under `torch.no_grad()` it is a plain all-gather.

    Args:
        x (`torch.Tensor`): this rank's rows.
        rows (`list[int]`, *optional*): every rank's number of rows, when they may differ ([`gather_sizes`]): each
            part is zero-padded to the largest for the collective and trimmed back after it.
        length (`int`, *optional*): zero-pad dim 1 to this (e.g. token sequences of different lengths per rank).
    """
    size, _ = world()
    if size == 1:
        return x
    from torch.distributed.nn.functional import all_gather

    target = list(x.shape)
    if rows is not None:
        target[0] = max(rows)
    if length is not None:
        target[1] = length
    parts = all_gather(_pad_to(x.contiguous(), target))
    if rows is None:
        return torch.cat(parts, dim=0)
    return torch.cat([part[:n] for part, n in zip(parts, rows)], dim=0)


__all__ = ["all_gather_with_grad", "gather_sizes", "world"]
