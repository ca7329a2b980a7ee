"""Valid calls of the raw validators (kvplan.validate) and, per rule of docs/kernels.md §6 in its order, a change that
breaks that rule alone: shared by the validators' tests (tests/validate/test_validate.py) and the error docs' test
(tests/docs/test_errors_doc.py). Texts are written out here rather than imported, so the tests check the module
against the spec, not against itself."""

from __future__ import annotations

import torch

I32, I64 = torch.int32, torch.int64

# --------------------------------------------------------------------------------------------------------------------
# Miss plan

B, S, K = 3, 2, 4  # capacity S*K = 8


def spec_plan(batch=B, steps=S, top_k=K, columns=None, rows=None):
    """A valid speculative call: top-k [batch, steps, top_k] and exactly sized contiguous plan tensors."""
    columns = steps * top_k if columns is None else columns
    rows = batch if rows is None else rows
    return {
        "top_k_tokens": torch.zeros(batch, steps, top_k, dtype=I32),
        "miss_src": torch.zeros(rows, columns, dtype=I64),
        "miss_dst": torch.zeros(rows, columns, dtype=I32),
        "miss_count": torch.zeros(rows, dtype=I32),
    }


def single_plan(batch=B, top_k=K, columns=None, rows=None):
    args = spec_plan(batch, 1, top_k, columns, rows)
    args["top_k_tokens"] = args["top_k_tokens"][:, 0]
    return args


def spec_capacity_text(capacity):
    return f"speculative miss_src/miss_dst must have shape [batch, >= steps * top_k] (capacity {capacity})."


# Each rule of the speculative check, in the spec's order (kvplan's own rules last), as a change to a valid call that
# breaks that rule alone. Changes are applied latest rule first, so an earlier rule's change acts on what a later one
# made; the call must then report the earlier rule.
def _wider(t):
    return torch.zeros(t.shape[0], t.shape[1] + 3, dtype=t.dtype)[:, : t.shape[1]]


PLAN_RULES = [
    ("top_k", lambda a: a.update(top_k_tokens=a["top_k_tokens"][:, 0]), "speculative top_k_tokens must have shape"),
    ("together", lambda a: a.update(miss_count=None), "miss_src, miss_dst, and miss_count must be provided together."),
    ("src_dtype", lambda a: a.update(miss_src=a["miss_src"].to(I32)), "miss_src must be int64 and miss_dst must be"),
    ("count_dtype", lambda a: a.update(miss_count=a["miss_count"].to(I64)), "miss_count must be int32."),
    ("src_rows", lambda a: a.update(miss_src=a["miss_src"][: B - 1]), spec_capacity_text(S * K)),
    ("count_rows", lambda a: a.update(miss_count=a["miss_count"][: B - 1]), "speculative miss_count must have shape"),
    ("strides", lambda a: a.update(miss_dst=_wider(a["miss_dst"])), "miss_src/miss_dst row strides must match."),
    ("device", lambda a: a.update(miss_count=a["miss_count"].to("meta")), "miss_src, miss_dst and miss_count must be"),
    (
        "columns",
        lambda a: a.update(miss_src=a["miss_src"].t().contiguous().t(), miss_dst=a["miss_dst"].t().contiguous().t()),
        "miss_src/miss_dst must have unit column stride",
    ),
    ("count_stride", lambda a: a.update(miss_count=a["miss_count"].repeat(2)[::2]), "miss_count must have unit stride"),
]


# --------------------------------------------------------------------------------------------------------------------
# Materialize

T, LYR, H, D, ROT = 3, 2, 2, 8, 8


def mat_args(total_ctx=T, n_layers=LYR, heads=H, dim=D, rotary=ROT, with_outputs=True):
    """A valid materialize call with given outputs."""
    args = {
        "kv": torch.zeros(total_ctx, n_layers, 2 * heads * dim),
        "k_norm_weight": torch.ones(n_layers, dim),
        "eps": torch.full((n_layers,), 1e-6),
        "cos_sin_cache": torch.zeros(16, rotary),
        "positions": torch.arange(total_ctx),
        "num_kv_heads": heads,
        "head_dim": dim,
        "rotary_dim": rotary,
    }
    if with_outputs:
        args["k_out"] = torch.zeros(n_layers, total_ctx, heads, dim)
        args["v_out"] = torch.zeros(n_layers, total_ctx, heads, dim)
    return args


def _strided_last(t):
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]


# Materialize rules in the spec's order, then kvplan's own; same scheme as PLAN_RULES.
MAT_RULES = [
    ("kv_3d", lambda a: a.update(kv=a["kv"][:, 0]), "Invalid stacked fused KV projection shape"),
    ("trailing", lambda a: a.update(kv=a["kv"][..., :-2]), "Invalid fused KV projection shape"),
    ("rotary", lambda a: a.update(rotary_dim=3), "Invalid fused KV rotary/head dim pair"),
    ("weight", lambda a: a.update(k_norm_weight=a["k_norm_weight"][:, :-1]), "Invalid stacked k_norm_weight shape"),
    ("eps", lambda a: a.update(eps=a["eps"][:-1]), "Invalid stacked eps shape"),
    ("cache", lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:, :-2]), "Invalid cos_sin_cache shape"),
    ("positions", lambda a: a.update(positions=a["positions"][:-1]), "positions must match kv token count"),
    ("k_out_shape", lambda a: a.update(k_out=a["k_out"][:, :-1]), "Invalid k_out shape"),
    ("k_out_dtype", lambda a: a.update(k_out=a["k_out"].double()), "Invalid k_out device/dtype"),
    ("v_out_shape", lambda a: a.update(v_out=a["v_out"][:, :-1]), "Invalid v_out shape"),
    ("v_out_device", lambda a: a.update(v_out=a["v_out"].to("meta")), "Invalid v_out device/dtype"),
    (
        "kv_dtype",
        lambda a: a.update(kv=a["kv"].to(I32), k_out=a["k_out"].to(I32), v_out=a["v_out"].to(I32)),
        "kv must be a floating tensor",
    ),
    ("weight_dtype", lambda a: a.update(k_norm_weight=a["k_norm_weight"].to(I32)), "k_norm_weight must be a floating"),
    ("eps_device", lambda a: a.update(eps=a["eps"].to("meta")), "eps must be on kv's device"),
    ("cache_rows", lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:0]), "cos_sin_cache must have at least one"),
    ("positions_dtype", lambda a: a.update(positions=a["positions"].float()), "positions must be an integer tensor"),
    ("kv_stride", lambda a: a.update(kv=_strided_last(a["kv"])), "kv must have a unit stride"),
    ("k_out_stride", lambda a: a.update(k_out=_strided_last(a["k_out"])), "k_out must have a unit stride"),
]
