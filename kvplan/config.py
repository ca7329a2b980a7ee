"""Pool configuration: how buffers grow (``PoolConfig``) and the model's KV slab geometry (``MaterializeGeometry``).

Both are frozen and validated on construction, so a pool never starts from a configuration it would only reject
at the first growth, deep inside a serving step.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable

import attrs
import torch

from kvplan.errors import NotAnIntError

__all__ = [
    "GROWTH_POLICIES", "LAUNCH_REPLAY_POLICIES", "MAX_TENSOR_BYTES", "MaterializeGeometry", "PoolConfig", "as_device",
    "as_float", "as_int", "env_flag", "int_in", "launch_replay_error", "not_one_of", "sizes",
]  # fmt: skip

GROWTH_POLICIES = ("exact", "geometric", "bucketed")
# How recorded launches are relaunched (PoolConfig.launch_replay, kvplan.runtime.launch_replay.LaunchCache's replay): as
# one CUDA graph, launch by launch, or not at all. Checked by launch_replay_error, for both.
LAUNCH_REPLAY_POLICIES = ("graph", "plain", "off")
# The most bytes a tensor can hold, and the most elements along one dimension: torch sizes and byte counts are int64.
MAX_TENSOR_BYTES = (1 << 63) - 1


def not_one_of(name: str, value: object, allowed: tuple[str, ...]) -> ValueError | None:
    """``value`` must be one of ``allowed`` (a policy's names): ``{name} must be one of 'a', 'b', got {value!r}``."""
    if value in allowed:
        return None
    return ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def launch_replay_error(name: str, value: object) -> ValueError | None:
    """The launch-replay policy's one rule (``PoolConfig.launch_replay`` and ``LaunchCache``'s ``replay``, each naming
    itself as ``name``): one of :data:`LAUNCH_REPLAY_POLICIES`."""
    return not_one_of(name, value, LAUNCH_REPLAY_POLICIES)


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is an integer (an int or a NumPy integer), else None. Bools (NumPy's
    included) and tensors are not integers here: a flag or a device value passed as a size is a mistake."""
    if type(value) is int:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def plain_int(value: object) -> object:
    """An integer (NumPy's too) as a Python int, anything else as it is (a check or validator later names it): the
    attrs converter of integer fields, and the kernels' normalisation of their size arguments."""
    integer = as_int(value)
    return value if integer is None else integer


def int_in(value: object, low: int, high: int | None, message: Callable[[], str]) -> int:
    """The one rule for an int argument: an int (NumPy's too) in ``[low, high]`` (``high=None``: no bound) is returned
    as a Python int; any other type (a bool, a float, a tensor) is :class:`~kvplan.errors.NotAnIntError`, a
    ``TypeError``; a value out of range is a ``ValueError``. ``message()`` is the text of both (built only then)."""
    integer = value if type(value) is int else as_int(value)
    if integer is None:
        raise NotAnIntError(message())
    if integer < low or (high is not None and integer > high):
        raise ValueError(message())
    return integer


def as_device(owner: str, device: object) -> torch.device:
    """``device`` (a ``torch.device``, a str or a CUDA index) as a ``torch.device``; anything torch cannot parse is a
    ``ValueError`` (``TypeError`` for another type) naming ``owner`` and the value, without torch's list of every
    device type it knows."""
    if isinstance(device, torch.device):
        return device
    index = as_int(device)
    if index is None and not isinstance(device, str):
        raise TypeError(f"{owner}: device must be a torch.device, str or int, got {type(device).__name__} {device!r}")
    try:
        return torch.device(device if index is None else index)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{owner}: device must name a torch device (e.g. 'cpu', 'cuda', 'cuda:0'), got {device!r}"
        ) from None


def check_cuda_device(owner: str, device: torch.device) -> None:
    """A CUDA ``device`` must be one this process sees: refused in kvplan's words (torch's own is an assertion about
    its build, raised deep inside the first allocation)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"{owner}: device={str(device)!r} needs CUDA, but no CUDA device is available (torch.cuda.is_available() "
            "is False). Without a GPU use device='cpu' and set TRITON_INTERPRET=1 before kvplan.kernels is imported "
            "(Triton's interpreter runs the kernels on CPU tensors)."
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"{owner}: device={str(device)!r} names CUDA device {device.index}, but only "
            f"{torch.cuda.device_count()} are visible"
        )


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The environment switch ``name``: one of the usual true or false spellings (any case, surrounding blanks
    ignored), ``default`` when unset or empty; anything else is a ``ValueError`` naming the variable (``00`` or
    ``disable`` must not silently mean either)."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(
        f"{name} must be one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off), got {os.environ[name]!r}"
    )


def sizes(owner: str, **named: object) -> list[int]:
    """Each named value as a Python int >= 0, or ``TypeError``/``ValueError`` naming ``owner``, the argument and what
    was given (NumPy ints are ints; bools, floats and tensors are not)."""
    out = []
    for name, value in named.items():
        size = as_int(value)
        if size is None:
            raise TypeError(f"{owner}: {name} must be an int >= 0, got {type(value).__name__} {value!r}")
        if size < 0:
            raise ValueError(f"{owner}: {name} must be an int >= 0, got {size}")
        out.append(size)
    return out


def as_float(value: object) -> float | None:
    """``value`` as a Python float when it is a real number (int, float, NumPy's), else None; bools are not."""
    if type(value) is float:
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(owner: str):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not _is_int(value):
            raise TypeError(f"{owner}.{attribute.name} must be an int, got {type(value).__name__} {value!r}")
        if value <= 0:
            raise ValueError(f"{owner}.{attribute.name} must be > 0, got {value}")

    return check


def _check_growth(instance: PoolConfig, attribute: attrs.Attribute, value: object) -> None:
    if error := not_one_of("PoolConfig.growth", value, GROWTH_POLICIES):
        raise error


def _to_factor(value: object) -> float:
    factor = as_float(value)
    if factor is None:
        raise TypeError(f"PoolConfig.growth_factor must be a float, got {type(value).__name__} {value!r}")
    return factor


def _check_factor(instance: PoolConfig, attribute: attrs.Attribute, value: float) -> None:
    if not (math.isfinite(value) and value > 1.0):
        raise ValueError(f"PoolConfig.growth_factor must be a finite number > 1.0, got {value!r}")


def _to_buckets(value: object) -> tuple[int, ...]:
    """Any iterable of batch sizes, as a sorted tuple without duplicates (engines list graph sizes in any order)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"PoolConfig.batch_buckets must be a sequence of ints, got {type(value).__name__} {value!r}")
    given = tuple(value)
    buckets = tuple(as_int(b) for b in given)
    for b, original in zip(buckets, given):
        if b is None:
            kind = type(original).__name__
            raise TypeError(f"PoolConfig.batch_buckets must hold ints, got {kind} {original!r} in {given}")
        if b <= 0:
            raise ValueError(f"PoolConfig.batch_buckets must hold batch sizes > 0, got {b} in {buckets}")
    return tuple(sorted(set(buckets)))


def _check_max_bytes(instance: PoolConfig, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if not _is_int(value):
        raise TypeError(f"PoolConfig.max_bytes must be an int or None, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"PoolConfig.max_bytes must be >= 0 (or None for no budget), got {value}")


def _check_launch_records(instance: PoolConfig, attribute: attrs.Attribute, value: object) -> None:
    if not _is_int(value):
        raise TypeError(f"PoolConfig.launch_records must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value <= 1 << 20:
        raise ValueError(f"PoolConfig.launch_records must be in [0, {1 << 20}], got {value}")


def _default_launch_replay() -> str:
    """``"graph"``, or ``"plain"`` when the environment sets ``KVPLAN_GRAPH_RELAUNCH`` off (read per config built)."""
    return "graph" if env_flag("KVPLAN_GRAPH_RELAUNCH", True) else "plain"


def _check_launch_replay(instance: PoolConfig, attribute: attrs.Attribute, value: object) -> None:
    if error := launch_replay_error("PoolConfig.launch_replay", value):
        raise error


@attrs.frozen
class PoolConfig:
    """How a :class:`~kvplan.PlanBufferPool` grows.

    - ``growth``: ``"exact"`` (the requested size), ``"geometric"`` (at least ``growth_factor`` x the old capacity) or
      ``"bucketed"`` (batch rounded up to ``batch_buckets``, the engine's CUDA-graph batch sizes; above the largest
      bucket geometric with a warning; columns and context geometric).
    - ``max_bytes``: bound on the pool's reserved bytes after any growth (``None``: no bound). The old buffer still
      exists while its replacement is allocated; those transient bytes are not counted.
    - ``check``: the checked mode, for bring-up and debugging (slow: every launch synchronises and runs the plain
      PyTorch reference on copies of its inputs): each pool launch is compared with the reference and the first
      difference raises :class:`~kvplan.CheckMismatchError`. Also on with the environment variable
      ``KVPLAN_CHECK=1`` (``1/true/yes/on`` or ``0/false/no/off``, any case; anything else is refused). Never under
      CUDA-graph capture or ``torch.compile`` (it reads the device).
    - ``launch_records``: eager launch layouts the pool remembers (least recently used dropped first): a call laid
      out like a recorded one skips its checks and relaunches the recorded kernels, as one CUDA graph from its second
      relaunch (``launch_replay``). Each graph holds device memory; ``stats()`` counts records and graphs, and a
      growth or trim drops them (their buffers moved). ``0``: every call checked and launched in full.
    - ``launch_replay``: how a recorded call is launched again. ``"graph"`` (the default): its recorded launches are
      relaunched without their checks, and a call of several launches is captured as one CUDA graph on its second
      relaunch (one graph launch instead of several Triton launches: the least host time, at the cost of each
      graph's device memory). ``"plain"``: relaunched launch by launch, no graph. ``"off"``: nothing is recorded,
      every call is checked and launched (for an engine that captures its own CUDA graphs around every pool call,
      or to debug). The environment variable ``KVPLAN_GRAPH_RELAUNCH=0`` (``0/false/no/off``, any case) makes the
      default ``"plain"``; a value given here wins.
    """

    growth: str = attrs.field(default="geometric", validator=_check_growth)
    growth_factor: float = attrs.field(default=2.0, converter=_to_factor, validator=_check_factor)
    batch_buckets: tuple[int, ...] = attrs.field(default=(), converter=_to_buckets)
    max_bytes: int | None = attrs.field(default=None, converter=plain_int, validator=_check_max_bytes)
    check: bool = attrs.field(factory=lambda: env_flag("KVPLAN_CHECK", False),
                              validator=attrs.validators.instance_of(bool))  # fmt: skip
    launch_records: int = attrs.field(default=64, converter=plain_int, validator=_check_launch_records)
    launch_replay: str = attrs.field(factory=_default_launch_replay, validator=_check_launch_replay)

    def __attrs_post_init__(self) -> None:
        if self.growth == "bucketed" and not self.batch_buckets:
            raise ValueError(
                "PoolConfig.batch_buckets must list the CUDA-graph batch sizes when growth='bucketed', got ()"
            )
        if self.growth != "bucketed" and self.batch_buckets:
            raise ValueError(
                f"PoolConfig.batch_buckets={self.batch_buckets} is only used by growth='bucketed', "
                f"got growth={self.growth!r}; drop the buckets or set growth='bucketed'"
            )


def _check_dtype(instance: MaterializeGeometry, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"MaterializeGeometry.dtype must be a torch.dtype, got {type(value).__name__} {value!r}")
    if not value.is_floating_point:
        raise ValueError(f"MaterializeGeometry.dtype must be a floating dtype (e.g. torch.bfloat16), got {value}")


@attrs.frozen
class MaterializeGeometry:
    """The draft model's KV slab shape: ``k_out``/``v_out`` are ``[n_layers, total_ctx, num_kv_heads, head_dim]`` of
    ``dtype``. Fixed for a pool's lifetime; only the context grows. ``projection=True`` also gives the pool the fused
    KV projection a :class:`~kvplan.FusedKVMaterializer` writes its GEMM into (buffer ``kv_proj``, ``[total_ctx,
    n_layers * 2 * num_kv_heads * head_dim]``), so the pool's budget, stats and ``freeze()`` cover it too."""

    n_layers: int = attrs.field(converter=plain_int, validator=_positive_int("MaterializeGeometry"))
    num_kv_heads: int = attrs.field(converter=plain_int, validator=_positive_int("MaterializeGeometry"))
    head_dim: int = attrs.field(converter=plain_int, validator=_positive_int("MaterializeGeometry"))
    dtype: torch.dtype = attrs.field(validator=_check_dtype)
    projection: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def elements_per_token(self) -> int:
        """Elements one context token takes in one slab (all layers and heads)."""
        return self.n_layers * self.num_kv_heads * self.head_dim
