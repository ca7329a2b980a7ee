"""The miss plan: which host rows a swap-in copied to which device rows, for later layers to replay."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

__all__ = ["MissPlan"]


@attrs.frozen(eq=False)
class MissPlan:
    """One step's miss plan: ``src`` int64 and ``dst`` int32 ``[batch, >= steps * top_k]`` with one row stride (host
    and device row of each copy), ``count`` int32 ``[>= batch]`` (copies per batch row).

    A pool hands out views of its buffers with the ``generation`` they belong to (stale after a later growth); a plan
    of caller-owned tensors has ``generation=None``. Entries ``[0, count[b])`` of row ``b`` are defined after a
    swap-in; the rest is left as it was.
    """

    src: Tensor
    dst: Tensor
    count: Tensor
    generation: int | None = None

    @classmethod
    def allocate(cls, batch: int, columns: int, device: torch.device | str) -> MissPlan:
        """A caller-owned plan of ``[batch, columns]`` rows (``columns = steps * top_k``), contents undefined."""
        return cls(
            src=torch.empty(batch, columns, dtype=torch.int64, device=device),
            dst=torch.empty(batch, columns, dtype=torch.int32, device=device),
            count=torch.empty(batch, dtype=torch.int32, device=device),
        )


def traceable_plan(src: Tensor, dst: Tensor, count: Tensor, generation: int | None) -> MissPlan:
    """A ``MissPlan`` built field by field, as attrs' generated ``__init__`` does (MissPlan has no validators or
    converters to skip). Dynamo cannot trace that ``__init__`` of a frozen slotted class (it binds
    ``object.__setattr__`` through a descriptor), nor compile its frame alone after a graph break in a caller."""
    plan = object.__new__(MissPlan)
    for name, value in (("src", src), ("dst", dst), ("count", count), ("generation", generation)):
        object.__setattr__(plan, name, value)
    return plan
