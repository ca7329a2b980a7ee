"""FusedKVMaterializer: a draft model's per-step context KV in one GEMM and one fused kernel, for all layers at once.

DFlash-style drafts project the same context hidden states through every layer's KV projection. Stacking the layers'
weights once into ``[Lyr*2*H*D, hidden]`` makes that a single GEMM whose ``[T, Lyr*2*H*D]`` output already is the
fused kernel's ``kv [T, Lyr, 2*H*D]``; the kernel then writes normalized, rotated K and V into layer-major slabs,
and ``write_layer_kv`` hands each layer's ``[T, H, D]`` views to the engine.

The step's scratch has one owner: a :class:`~kvplan.PlanBufferPool` with ``MaterializeGeometry(..., projection=True)``
holds the GEMM output (``kv_proj``) and the slabs (``k_out``/``v_out``), the engine's or one the materializer builds
(and sizes) itself, so one growth, budget, ``freeze()`` and ``stats()`` cover everything it writes. Steady state
allocates nothing: the GEMM writes into the pool's buffer through ``out=``. With ``max_position_hint`` no host check
runs, so the whole call can be captured in a CUDA graph; ``refresh_weights`` copies new weights into the same storage,
so a captured graph sees them on its next replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvplan.config import MaterializeGeometry, as_int, int_in, sizes
from kvplan.errors import PoolBudgetError, PoolFrozenError
from kvplan.pool import PlanBufferPool
from kvplan.validate.arguments import eps_per_layer

__all__ = ["FusedKVMaterializer"]

WriteLayerKV = Callable[[int, torch.Tensor, torch.Tensor], None]
Weights = torch.Tensor | Sequence[torch.Tensor]


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _stack(name: str, value: Weights, per_layer_shape: tuple[int, ...], num_layers: int | None) -> torch.Tensor:
    """``value`` as one ``[Lyr, *per_layer_shape]`` tensor (a view when it already is one); checks every shape."""
    if isinstance(value, torch.Tensor):
        if value.dim() == len(per_layer_shape) and value.shape[0] % per_layer_shape[0] == 0 and value.shape[0] > 0:
            value = value.view(-1, *per_layer_shape) if value.is_contiguous() else value.reshape(-1, *per_layer_shape)
        if value.dim() != len(per_layer_shape) + 1 or tuple(value.shape[1:]) != per_layer_shape:
            raise ValueError(
                f"{name} must have shape [n_layers, {', '.join(map(str, per_layer_shape))}] "
                f"(or per-layer {list(per_layer_shape)} stacked), got {tuple(value.shape)}"
            )
        stacked = value
    else:
        if not isinstance(value, Sequence):
            raise TypeError(f"{name} must be a tensor or a sequence of per-layer tensors, got {type(value).__name__}")
        layers = list(value)
        if not layers:
            raise ValueError(f"{name} must hold at least one layer, got an empty sequence")
        for i, layer in enumerate(layers):
            _require_tensor(f"{name}[{i}]", layer)
            if tuple(layer.shape) != per_layer_shape:
                raise ValueError(f"{name}[{i}] must have shape {per_layer_shape}, got {tuple(layer.shape)}")
            if layer.dtype != layers[0].dtype or layer.device != layers[0].device:
                raise ValueError(
                    f"{name}[{i}] must match {name}[0]'s dtype and device ({layers[0].dtype}, {layers[0].device}), "
                    f"got ({layer.dtype}, {layer.device})"
                )
        stacked = torch.stack(layers)
    if num_layers is not None and stacked.shape[0] != num_layers:
        raise ValueError(f"{name} must hold {num_layers} layers, got {stacked.shape[0]}")
    return stacked


def _check_floating(name: str, tensor: torch.Tensor, what: str) -> None:
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating ({what}), got {tensor.dtype}")


class FusedKVMaterializer:
    """Projects context hidden states to K/V for every draft layer in one GEMM, then one fused norm+RoPE kernel.

    Args:
        kv_proj_weights: per-layer KV projections ``[2*H*D, hidden]`` (K rows then V rows, as the layer's
            ``kv_proj``/``wkv``), as a list, a stacked ``[Lyr, 2*H*D, hidden]`` or ``[Lyr*2*H*D, hidden]`` tensor.
        k_norm_weights: per-layer K RMSNorm weights ``[D]`` (list) or ``[Lyr, D]``.
        eps: per-layer RMSNorm epsilon (a list, a ``[Lyr]`` tensor, or one float for all layers).
        cos_sin_cache: ``[max_pos, >= rotary_dim]``, cosines then sines per row (kept by reference, not copied).
        num_kv_heads, head_dim: the draft's K/V heads and head size (default: the pool's geometry's).
        rotary_dim: the rotated part of each head (default ``head_dim``: full neox rotary).
        pool: a :class:`kvplan.PlanBufferPool` built with ``geometry=MaterializeGeometry(..., projection=True)`` of
            this model: its ``kv_proj`` buffer receives the GEMM and its slabs the K/V (``pool.kv_out(T)``), so its
            budget, stats and ``freeze()`` cover everything the materializer writes. The engine sizes it with
            ``ensure_capacity(total_ctx=...)``. Without one the materializer builds such a pool (``self.pool``) and
            sizes it on every call (grow-only; ``reserve`` before graph capture).
        max_position_hint: a promise that positions stay below this bound; then positions are never checked on the
            host (graph-capturable; out-of-range ones are still clamped in the kernel). Without it every call checks
            them, which synchronises with the device.
    """

    def __init__(
        self,
        kv_proj_weights: Weights,
        k_norm_weights: Weights,
        eps: float | Sequence[float] | torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rotary_dim: int | None = None,
        pool: PlanBufferPool | None = None,
        max_position_hint: int | None = None,
    ) -> None:
        if pool is not None and not isinstance(pool, PlanBufferPool):
            raise TypeError(
                "FusedKVMaterializer: pool must be a PlanBufferPool built with geometry=MaterializeGeometry(..., "
                f"projection=True) (or None: the materializer then builds its own), got {type(pool).__name__}"
            )
        geometry = None if pool is None else pool.geometry
        if geometry is not None:  # the pool's geometry has what was not given (what was is checked against it)
            num_kv_heads = geometry.num_kv_heads if num_kv_heads is None else num_kv_heads
            head_dim = geometry.head_dim if head_dim is None else head_dim
        elif pool is not None:  # a pool without slabs cannot take the K/V at all
            raise ValueError(
                "FusedKVMaterializer: pool has no materialize slabs; build it with "
                "geometry=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype, projection=True) (or pass no "
                "pool: the materializer then builds its own)"
            )
        if num_kv_heads is None or head_dim is None:
            raise TypeError(
                "FusedKVMaterializer needs num_kv_heads and head_dim (or a pool built with a MaterializeGeometry, "
                f"which has them), got num_kv_heads={num_kv_heads!r}, head_dim={head_dim!r}"
            )
        if rotary_dim is None:  # full neox rotary, as DFlash drafts use
            rotary_dim = head_dim
        dims = []
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("rotary_dim", rotary_dim)):
            size = as_int(value)
            if size is None:
                raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
            if size <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            dims.append(size)
        num_kv_heads, head_dim, rotary_dim = dims
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(  # the engines' text (docs/kernels.md §6), then the fix
                f"Invalid fused KV rotary/head dim pair: rotary_dim={rotary_dim}, head_dim={head_dim}. "
                "rotary_dim must be even and in [2, head_dim]."
            )
        _require_tensor("cos_sin_cache", cos_sin_cache)
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[0] == 0 or cos_sin_cache.shape[1] < rotary_dim:
            raise ValueError(
                f"cos_sin_cache must have shape [max_pos >= 1, >= {rotary_dim}], got {tuple(cos_sin_cache.shape)}"
            )
        max_pos = cos_sin_cache.shape[0]
        if max_position_hint is not None:
            max_position_hint = int_in(max_position_hint, 1, max_pos, lambda: (
                f"max_position_hint must be an int in [1, {max_pos}] (cos_sin_cache rows), got {max_position_hint!r}"
            ))  # fmt: skip

        self.num_kv_heads, self.head_dim, self.rotary_dim = num_kv_heads, head_dim, rotary_dim
        kv_size = 2 * num_kv_heads * head_dim
        if isinstance(kv_proj_weights, torch.Tensor) and kv_proj_weights.dim() not in (2, 3):
            raise ValueError(
                f"kv_proj_weights must be a list of [{kv_size}, hidden] tensors or a stacked tensor, "
                f"got shape {tuple(kv_proj_weights.shape)}"
            )
        first = kv_proj_weights if isinstance(kv_proj_weights, torch.Tensor) else _first(kv_proj_weights)
        hidden = first.shape[-1]
        weights = _stack("kv_proj_weights", kv_proj_weights, (kv_size, hidden), None)
        self.num_layers = weights.shape[0]
        self.hidden_size = hidden
        norms = _stack("k_norm_weights", k_norm_weights, (head_dim,), self.num_layers)
        eps_values = eps_per_layer(eps, self.num_layers)
        device = weights.device
        for name, tensor in (("k_norm_weights", norms), ("cos_sin_cache", cos_sin_cache)):
            if tensor.device != device:
                raise ValueError(f"{name} must be on the weights' device {device}, got {tensor.device}")
        # everything the first materialize() would refuse, refused now
        _check_floating("kv_proj_weights", weights, "the draft's KV dtype")
        _check_floating("k_norm_weights", norms, "read as float32 by the kernel")
        _check_floating("cos_sin_cache", cos_sin_cache, "read as float32 by the kernel")
        self.device, self.dtype = device, weights.dtype
        if pool is None:  # its own pool, sized by materialize() and reserve()
            geometry = MaterializeGeometry(self.num_layers, num_kv_heads, head_dim, self.dtype, projection=True)
            pool = PlanBufferPool(device, geometry=geometry)
            self._own_pool = True
        else:
            _check_pool(pool, self.num_layers, num_kv_heads, head_dim, self.dtype, device)
            self._own_pool = False
        # [Lyr*2*H*D, hidden]: ctx_hidden @ weight.T is kv [T, Lyr, 2*H*D] with no copy. Copies of the model's
        # weights, outside autograd (nn.Parameters would otherwise make every later GEMM a differentiable op).
        with torch.no_grad():
            self.weight = torch.empty((self.num_layers * kv_size, hidden), dtype=self.dtype, device=device)
            self.weight.view(self.num_layers, kv_size, hidden).copy_(weights)
            self.k_norm_weight = norms.detach().clone(memory_format=torch.contiguous_format)
            self.eps = eps_values.to(device)
            self.cos_sin_cache = cos_sin_cache.detach()
        self.pool = pool  # the GEMM output (kv_proj) and the K/V slabs: the step's scratch, in one place
        self.max_position_hint = max_position_hint

    # --- sizing ------------------------------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool's projection buffer (``kv_proj``) holds without growing."""
        return self.pool.stats().buffer("kv_proj").capacity[0][1]

    def reserve(self, max_tokens: int) -> None:
        """Size the pool for ``max_tokens`` now (do it before capturing a CUDA graph):
        ``pool.reserve(batch=0, total_ctx=max_tokens)``, combined with the pool's other reservations."""
        (tokens,) = sizes("FusedKVMaterializer.reserve", max_tokens=max_tokens)
        try:
            self.pool.reserve(batch=0, total_ctx=tokens)
            if self._own_pool:  # the step's request fits from now on: materialize() finds it with a dict lookup
                self.pool.ensure_capacity(batch=0, total_ctx=tokens)
        except (PoolFrozenError, PoolBudgetError) as exc:
            raise _named(exc, f"FusedKVMaterializer.reserve(max_tokens={tokens})", tokens) from exc

    # --- the step ---------------------------------------------------------------------------------------------------
    def materialize(
        self,
        ctx_hidden: torch.Tensor,
        positions: torch.Tensor,
        write_layer_kv: WriteLayerKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of every layer for ``ctx_hidden [T, hidden]`` at ``positions [T]``, as ``[Lyr, T, H, D]`` ``(k, v)``.

        ``write_layer_kv(layer, k, v)`` is then called once per layer with that layer's ``[T, H, D]`` views. The
        views are step-scoped: the next call (or a pool growth) overwrites what they show, so copy what must outlive it.
        """
        _require_tensor("ctx_hidden", ctx_hidden)
        _require_tensor("positions", positions)
        if ctx_hidden.dim() != 2 or ctx_hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"ctx_hidden must have shape [total_ctx, {self.hidden_size}], got {tuple(ctx_hidden.shape)}"
            )
        if ctx_hidden.dtype != self.dtype or ctx_hidden.device != self.device:
            raise ValueError(
                f"ctx_hidden must have dtype={self.dtype} on device={self.device}, "
                f"got dtype={ctx_hidden.dtype} on device={ctx_hidden.device}"
            )
        T = ctx_hidden.shape[0]
        if self._own_pool:  # (a given pool is the engine's to size, with ensure_capacity(total_ctx=...))
            try:
                self.pool.ensure_capacity(batch=0, total_ctx=T)  # a dict lookup when it fits
            except (PoolFrozenError, PoolBudgetError) as exc:
                raise _named(exc, f"FusedKVMaterializer.materialize() of {T} tokens", T) from exc
        with torch.no_grad():  # inference only: hidden states that require grad are read, not differentiated
            k_out, v_out = self._project_and_materialize(ctx_hidden, positions, T)
        if write_layer_kv is not None and T > 0:  # an empty context writes nothing, as SGLang's per-layer helper
            for layer in range(self.num_layers):
                write_layer_kv(layer, k_out[layer], v_out[layer])
        return k_out, v_out

    def _project_and_materialize(
        self, ctx_hidden: torch.Tensor, positions: torch.Tensor, T: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv_flat = self.pool.kv_proj(T)
        torch.matmul(ctx_hidden, self.weight.t(), out=kv_flat)
        return self.pool.materialize(
            kv_flat.view(T, self.num_layers, 2 * self.num_kv_heads * self.head_dim),
            self.k_norm_weight,
            self.eps,
            self.cos_sin_cache,
            positions,
            rotary_dim=self.rotary_dim,
            check_positions=self.max_position_hint is None,
        )

    # --- weights ----------------------------------------------------------------------------------------------------
    def refresh_weights(
        self,
        kv_proj_weights: Weights | None = None,
        k_norm_weights: Weights | None = None,
        eps: float | Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        """Copy new weights into the existing storage (same data pointers, so captured graphs use them).

        Everything given is checked before anything is copied: the shapes, dtypes and device the materializer was
        built with (what the constructor checks), so an update is applied whole or not at all.
        """
        kv_size = 2 * self.num_kv_heads * self.head_dim
        weights = norms = eps_values = None
        if kv_proj_weights is not None:
            weights = _stack("kv_proj_weights", kv_proj_weights, (kv_size, self.hidden_size), self.num_layers)
            _check_like("kv_proj_weights", weights, self.weight)
        if k_norm_weights is not None:
            norms = _stack("k_norm_weights", k_norm_weights, (self.head_dim,), self.num_layers)
            _check_like("k_norm_weights", norms, self.k_norm_weight)
        if eps is not None:
            eps_values = eps_per_layer(eps, self.num_layers)
        with torch.no_grad():
            if weights is not None:
                self.weight.view(self.num_layers, kv_size, self.hidden_size).copy_(weights)
            if norms is not None:
                self.k_norm_weight.copy_(norms)
            if eps_values is not None:
                self.eps.copy_(eps_values)


def _check_like(name: str, given: torch.Tensor, stored: torch.Tensor) -> None:
    """New weights must have the dtype and device of the storage they are copied into (no silent cast or transfer)."""
    if given.dtype != stored.dtype or given.device != stored.device:
        raise ValueError(
            f"{name} must have the dtype and device the materializer was built with ({stored.dtype}, "
            f"{stored.device}), got ({given.dtype}, {given.device})"
        )


def _first(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    if not isinstance(layers, Sequence):
        raise TypeError(
            f"kv_proj_weights must be a tensor or a sequence of per-layer tensors, got {type(layers).__name__}"
        )
    layers = list(layers)
    if not layers:
        raise ValueError("kv_proj_weights must hold at least one layer, got an empty sequence")
    first = _require_tensor("kv_proj_weights[0]", layers[0])
    if first.dim() != 2:
        raise ValueError(f"kv_proj_weights[0] must have shape [kv_size*2, hidden], got {tuple(first.shape)}")
    return first


def _check_pool(
    pool: PlanBufferPool, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """The pool must hold this model's projection and slabs, on the weights' device (checked once, not per step)."""
    geometry = pool.geometry  # (never None: __init__ refused a pool without slabs)
    given = (geometry.n_layers, geometry.num_kv_heads, geometry.head_dim, geometry.dtype)
    expected = (num_layers, num_kv_heads, head_dim, dtype)
    build = f"geometry=MaterializeGeometry({num_layers}, {num_kv_heads}, {head_dim}, {dtype}, projection=True)"
    if given != expected:
        raise ValueError(
            "pool geometry must match the materializer's (n_layers, num_kv_heads, head_dim, dtype): "
            f"expected {expected}, got {given}. Build the pool with {build}."
        )
    if not geometry.projection:
        raise ValueError(
            "FusedKVMaterializer: pool holds no fused KV projection (the GEMM output the materializer writes); build "
            f"it with {build} (or pass no pool: the materializer then builds its own)"
        )
    if pool.device != device:
        raise ValueError(f"FusedKVMaterializer: pool is on {pool.device}, the weights on {device}; build it there")


def _named(exc: PoolFrozenError | PoolBudgetError, call: str, tokens: int) -> RuntimeError:
    """A refusal of the pool, of the same class, naming the materializer's call (and, for a growth refused while
    frozen or capturing, the materializer's own ``reserve`` to make before capture)."""
    if isinstance(exc, PoolFrozenError):
        return PoolFrozenError(
            f"{call}: {exc} On the materializer: call reserve(max_tokens={tokens}) (the engine's maximum context) "
            "before freeze() and graph capture."
        )
    return PoolBudgetError(f"{call}: {exc} The materializer is unchanged.")
