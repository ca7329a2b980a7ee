"""Helpers of the hostile-input tests: tensors placed in strided, padded, permuted or expanded views inside larger
buffers whose every element outside the view must come back untouched (a guard region around each argument).

``Arena.place(name, t, layout)`` returns a view holding ``t``'s values with the chosen layout; ``Arena.check()``
asserts that nothing outside any view changed. Layouts:

- ``dense``: a contiguous copy (the baseline);
- ``guarded``: guard rows before and after, rows padded by extra columns; a 1-D tensor stays contiguous;
- ``padded``: rows padded by extra columns, guard rows before and after; a 1-D tensor every second element;
- ``permuted``: the dims stored in reverse order (column-major for a matrix), padded the same way;
- ``expanded``: the first row (or element) broadcast to every row with stride 0 (values change: every row equals
  the first).
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYOUTS = ("dense", "guarded", "padded", "permuted", "expanded")
EDGE, PAD = 2, 3


def fill_value(dtype: torch.dtype) -> int | float:
    """A sentinel every dtype can hold and no kernel writes by chance."""
    if dtype.is_floating_point:
        return 1234.5
    if dtype == torch.uint8:
        return 0xAB
    if dtype == torch.bool:
        return True
    return -77


class Arena:
    """Views of given layouts inside guard buffers; ``check()`` asserts the guards kept their fill."""

    def __init__(self) -> None:
        self._buffers: list[tuple[str, Tensor, Tensor]] = []  # name, buffer, mask of what views cover

    def place(self, name: str, t: Tensor, layout: str) -> Tensor:
        if layout == "dense" or t.dim() == 0:
            return t.clone()
        if layout == "expanded":
            if t.shape[0] <= 1:
                return self.place(name, t, "padded")
            first = self.place(name, t[:1], "padded")
            return first.expand(t.shape)
        if layout not in ("guarded", "padded", "permuted"):
            raise ValueError(layout)
        order = list(range(t.dim()))
        if layout == "permuted":
            order.reverse()
        shape = list(t.shape)
        step = 2 if layout == "padded" else 1  # 1-D: every second element, or contiguous
        if t.dim() == 1:
            big_shape = [step * shape[0] + 2 * EDGE]
        else:
            big_shape = [n + (2 * EDGE if d == 0 else PAD if d == t.dim() - 1 else 0) for d, n in enumerate(shape)]
        # allocate with the dims in ``order`` (outermost first), then view back in logical order
        stored = torch.full([big_shape[d] for d in order], fill_value(t.dtype), dtype=t.dtype, device=t.device)
        inverse = [order.index(d) for d in range(t.dim())]
        big = stored.permute(inverse)
        if t.dim() == 1:
            view = big[EDGE : EDGE + step * shape[0] : step]
        else:
            view = big[(slice(EDGE, EDGE + shape[0]),) + tuple(slice(0, n) for n in shape[1:])]
        view.copy_(t)
        covered = torch.zeros(stored.shape, dtype=torch.bool, device=t.device)
        covered.permute(inverse).as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
        self._buffers.append((name, stored, covered))
        return view

    def check(self) -> None:
        for name, stored, covered in self._buffers:
            guard = stored[~covered]
            fill = fill_value(stored.dtype)
            if stored.dtype.is_floating_point:
                same = guard == fill
            else:
                same = guard == torch.tensor(fill, dtype=stored.dtype, device=stored.device)
            assert bool(same.all()), f"{name}: {int((~same).sum())} guard elements outside the view were written"


def snapshot(tensors: dict[str, Tensor | None]) -> dict[str, Tensor]:
    return {name: t.clone() for name, t in tensors.items() if isinstance(t, Tensor)}


def assert_unchanged(before: dict[str, Tensor], tensors: dict[str, Tensor | None]) -> None:
    for name, old in before.items():
        assert torch.equal(tensors[name], old), f"{name} changed although the call was refused"
