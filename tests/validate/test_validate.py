"""The raw validators: exact texts and order of docs/kernels.md §6, boundaries that pass, and guards that agree.

Texts are written out here (and in tests/helpers/validate_rules.py) rather than imported, so the tests check the module
against the spec, not against itself.
"""

from __future__ import annotations

import pytest
import torch
from helpers.validate_rules import (
    LYR,
    MAT_RULES,
    PLAN_RULES,
    ROT,
    B,
    D,
    H,
    K,
    S,
    T,
    mat_args,
    single_plan,
    spec_capacity_text,
    spec_plan,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.validate import (
    check_materialize,
    check_miss_plan,
    check_spec_miss_plan,
    materialize_fits,
    miss_plan_fits,
    spec_miss_plan_fits,
)
from kvplan.validate.messages import _same_device

I32, I64 = torch.int32, torch.int64


def assert_spec_message(error: BaseException, spec_text: str) -> None:
    message = str(error)
    assert message == spec_text or message.startswith(spec_text + " "), message


# --------------------------------------------------------------------------------------------------------------------
# Miss plan


def slab_views(batch, columns, width, height=None):
    """[:batch, :columns] views of taller/wider slabs (one shared row stride, as the pool hands them out)."""
    height = batch if height is None else height
    src = torch.zeros(height, width, dtype=I64)[:batch, :columns]
    dst = torch.zeros(height, width, dtype=I32)[:batch, :columns]
    return src, dst, torch.zeros(height, dtype=I32)[:batch]


def check_both(args, speculative):
    check, fits = (check_spec_miss_plan, spec_miss_plan_fits) if speculative else (check_miss_plan, miss_plan_fits)
    try:
        check(**args)
    except (TypeError, ValueError) as error:
        assert not fits(**args)
        return error
    assert fits(**args)
    return None


def expect_plan_error(args, spec_text, *, speculative=True, kind=ValueError):
    error = check_both(args, speculative)
    assert isinstance(error, kind), f"expected {kind.__name__}, got {error!r}"
    assert_spec_message(error, spec_text)


def expect_plan_ok(args, *, speculative=True):
    assert check_both(args, speculative) is None


def test_valid_plans_pass():
    expect_plan_ok(spec_plan())
    expect_plan_ok(single_plan(), speculative=False)


@pytest.mark.parametrize("speculative", [True, False])
def test_all_none_plan_passes(speculative):
    args = spec_plan() if speculative else single_plan()
    expect_plan_ok({**args, "miss_src": None, "miss_dst": None, "miss_count": None}, speculative=speculative)


@pytest.mark.parametrize("shape", [(B, S * K), (B, S, K, 1), (B,), ()])
def test_spec_top_k_must_be_3d(shape):
    args = {**spec_plan(), "top_k_tokens": torch.zeros(shape, dtype=I32)}
    expect_plan_error(args, "speculative top_k_tokens must have shape [batch, steps, top_k].")
    # The top-k shape is checked even when no plan is given.
    args = {**args, "miss_src": None, "miss_dst": None, "miss_count": None}
    expect_plan_error(args, "speculative top_k_tokens must have shape [batch, steps, top_k].")


@pytest.mark.parametrize("shape", [(B, S, K), (B,)])
def test_single_top_k_must_be_2d(shape):
    args = {**single_plan(), "top_k_tokens": torch.zeros(shape, dtype=I32)}
    expect_plan_error(args, "top_k_tokens must have shape [batch, top_k].", speculative=False)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize(
    "absent", [("miss_src",), ("miss_dst",), ("miss_count",), ("miss_src", "miss_dst"), ("miss_dst", "miss_count")]
)
def test_plan_tensors_come_together(speculative, absent):
    args = spec_plan() if speculative else single_plan()
    args.update(dict.fromkeys(absent))
    expect_plan_error(args, "miss_src, miss_dst, and miss_count must be provided together.", speculative=speculative)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("src_dtype, dst_dtype", [(I32, I32), (I64, I64), (I32, I64), (torch.uint8, I32)])
def test_plan_dtypes(speculative, src_dtype, dst_dtype):
    args = spec_plan() if speculative else single_plan()
    args["miss_src"] = args["miss_src"].to(src_dtype)
    args["miss_dst"] = args["miss_dst"].to(dst_dtype)
    expect_plan_error(args, "miss_src must be int64 and miss_dst must be int32.", speculative=speculative)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("dtype", [I64, torch.int16, torch.float32])
def test_miss_count_dtype(speculative, dtype):
    args = spec_plan() if speculative else single_plan()
    args["miss_count"] = args["miss_count"].to(dtype)
    expect_plan_error(args, "miss_count must be int32.", speculative=speculative)


@pytest.mark.parametrize("name", ["miss_src", "miss_dst"])
@pytest.mark.parametrize(
    "make",
    [
        lambda t: t[: B - 1],  # fewer than B rows
        lambda t: t[:, : S * K - 1],  # fewer than S*K columns
        lambda t: t.reshape(-1),  # 1-D
        lambda t: t.reshape(B, S, K),  # 3-D
        lambda t: t[:0],  # no rows
    ],
)
def test_spec_plan_shape(name, make):
    args = spec_plan()
    args[name] = make(args[name])
    expect_plan_error(args, spec_capacity_text(S * K))


def test_spec_capacity_text_states_steps_times_top_k_even_for_other_faults():
    args = spec_plan(batch=2, steps=4, top_k=16)
    args["miss_src"] = torch.zeros(64, dtype=I64)  # 1-D, and would be "enough" elements
    expect_plan_error(args, spec_capacity_text(64))
    args = spec_plan(batch=2, steps=4, top_k=16)
    args["miss_dst"] = torch.zeros(1, 64, dtype=I32)  # enough columns, too few rows
    expect_plan_error(args, spec_capacity_text(64))


def test_spec_capacity_hint_names_the_sizing_call():
    args = spec_plan(batch=4, steps=2, top_k=8, columns=8)
    with pytest.raises(ValueError) as info:
        check_spec_miss_plan(**args)
    assert str(info.value) == (
        spec_capacity_text(16) + " Got miss_src (4, 8), miss_dst (4, 8) for batch=4; size the plan with "
        "PlanBufferPool.ensure_capacity(batch=4, num_steps=2, top_k=8) and pass its views."
    )


@pytest.mark.parametrize("name", ["miss_src", "miss_dst"])
def test_single_plan_shape(name):
    args = single_plan()
    args[name] = args[name][:, : K - 1]
    expect_plan_error(args, f"miss_src/miss_dst must have shape [batch, >= top_k] (capacity {K}).", speculative=False)
    args = single_plan()
    args[name] = args[name][: B - 1]
    expect_plan_error(args, f"miss_src/miss_dst must have shape [batch, >= top_k] (capacity {K}).", speculative=False)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("shape", [(B - 1,), (0,), (B, 1), ()])
def test_miss_count_shape(speculative, shape):
    args = spec_plan() if speculative else single_plan()
    args["miss_count"] = torch.zeros(shape, dtype=I32)
    text = "speculative miss_count must have shape [batch]." if speculative else "miss_count must have shape [batch]."
    expect_plan_error(args, text, speculative=speculative)


@pytest.mark.parametrize("speculative", [True, False])
def test_row_strides_must_match(speculative):
    args = spec_plan() if speculative else single_plan()
    columns = args["miss_src"].shape[1]
    args["miss_dst"] = torch.zeros(B, columns + 3, dtype=I32)[:, :columns]
    expect_plan_error(args, "miss_src/miss_dst row strides must match.", speculative=speculative)


def test_plan_boundaries_pass():
    capacity = S * K
    expect_plan_ok(spec_plan())  # exactly batch rows, exactly steps*top_k columns
    expect_plan_ok(spec_plan(columns=capacity + 5))  # wider slabs
    expect_plan_ok(spec_plan(rows=B + 2))  # taller slabs
    expect_plan_ok(spec_plan(rows=B + 2, columns=capacity + 5))
    src, dst, count = slab_views(B, capacity, width=capacity + 7, height=B + 4)  # sliced views of wider slabs
    expect_plan_ok({**spec_plan(), "miss_src": src, "miss_dst": dst, "miss_count": count})
    expect_plan_ok(single_plan(columns=K + 1, rows=B + 1), speculative=False)


def test_batch_one_still_checks_row_strides():
    """The engines' check has no exception for one row: a [1, N] view beside a row of a wider slab is refused."""
    capacity = S * K
    args = spec_plan(batch=1)
    args["miss_dst"] = torch.zeros(4, capacity + 9, dtype=I32)[:1, :capacity]
    assert args["miss_src"].stride(0) != args["miss_dst"].stride(0)
    expect_plan_error(args, "miss_src/miss_dst row strides must match.")
    narrow = {**single_plan(batch=1), "miss_dst": torch.zeros(2, K + 3, dtype=I32)[:1, :K]}
    expect_plan_error(narrow, "miss_src/miss_dst row strides must match.", speculative=False)


def test_empty_batch_passes():
    expect_plan_ok(spec_plan(batch=0))
    expect_plan_ok(single_plan(batch=0), speculative=False)


def test_plan_on_another_device_is_refused():
    args = spec_plan()
    args["miss_count"] = torch.empty(B, dtype=I32, device="meta")
    with pytest.raises(ValueError, match="must be on top_k_tokens' device cpu"):
        check_spec_miss_plan(**args)
    assert not spec_miss_plan_fits(**args)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: torch.zeros(t.shape[1], t.shape[0], dtype=t.dtype).t(),  # column-major
        lambda t: torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)[:, ::2],  # stepped columns
        lambda t: torch.zeros(1, t.shape[1], dtype=t.dtype).expand(t.shape),  # every row aliases row 0
    ],
    ids=["column_major", "stepped_columns", "expanded_rows"],
)
def test_plan_layout_the_kernels_cannot_address_is_refused(make):
    """Row strides match (the spec's rule passes), but the kernels would write the wrong or the same elements."""
    args = spec_plan()
    args["miss_src"], args["miss_dst"] = make(args["miss_src"]), make(args["miss_dst"])
    assert args["miss_src"].stride(0) == args["miss_dst"].stride(0)
    with pytest.raises(ValueError, match="must have unit column stride and rows that do not overlap"):
        check_spec_miss_plan(**args)
    assert not spec_miss_plan_fits(**args)


def test_stepped_miss_count_is_refused():
    args = spec_plan()
    args["miss_count"] = torch.zeros(2 * B, dtype=I32)[::2]
    with pytest.raises(ValueError, match="miss_count must have unit stride: got stride 2"):
        check_spec_miss_plan(**args)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("name", ["miss_src", "miss_dst", "miss_count"])
def test_plan_non_tensor_is_type_error(speculative, name):
    args = spec_plan() if speculative else single_plan()
    args[name] = args[name].tolist()
    expect_plan_error(args, f"{name} must be a torch.Tensor or None, got list", speculative=speculative, kind=TypeError)


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("value", [None, [[1, 2]], 3])
def test_top_k_non_tensor_is_type_error(speculative, value):
    args = {**(spec_plan() if speculative else single_plan()), "top_k_tokens": value}
    expected = f"top_k_tokens must be a torch.Tensor, got {type(value).__name__}"
    expect_plan_error(args, expected, speculative=speculative, kind=TypeError)


def test_type_errors_come_before_value_errors():
    args = {**spec_plan(), "top_k_tokens": torch.zeros(B, K, dtype=I32), "miss_count": (0, 0, 0)}
    expect_plan_error(args, "miss_count must be a torch.Tensor or None, got tuple", kind=TypeError)


@pytest.mark.parametrize("index", range(len(PLAN_RULES)), ids=[rule[0] for rule in PLAN_RULES])
def test_each_plan_rule_alone(index):
    args = spec_plan()
    PLAN_RULES[index][1](args)
    error = check_both(args, speculative=True)
    assert isinstance(error, ValueError)
    assert str(error).startswith(PLAN_RULES[index][2])


def test_plan_rules_report_the_earliest():
    for later in range(len(PLAN_RULES)):
        for earlier in range(later):
            args = spec_plan()
            PLAN_RULES[later][1](args)
            PLAN_RULES[earlier][1](args)
            error = check_both(args, speculative=True)
            assert str(error).startswith(PLAN_RULES[earlier][2]), (PLAN_RULES[earlier][0], PLAN_RULES[later][0])


@st.composite
def plan_calls(draw):
    """Random calls, mostly near the sizes and layouts the call needs so that both outcomes are common."""
    speculative = draw(st.booleans())
    batch, steps, top_k = draw(st.integers(0, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 4))
    top_k_ndim = draw(st.sampled_from([3, 3, 3, 2] if speculative else [2, 2, 2, 3]))
    top_k_shape = (batch, steps, top_k)[:top_k_ndim] if speculative else ((batch, top_k) + (steps,))[:top_k_ndim]
    capacity = steps * top_k if speculative else top_k
    near = st.sampled_from([0, 0, 0, 0, 1, 2, -1])
    shared_width = capacity + draw(st.integers(0, 3))  # one slab width for src and dst, as the pool lays them out

    def plan_tensor(name, dtypes):
        if draw(st.integers(0, 9)) == 0:
            return None
        dtype = draw(st.sampled_from(dtypes))
        if name == "miss_count":
            return torch.zeros(max(batch + draw(near), 0), dtype=dtype)
        rows, columns = max(batch + draw(near), 0), max(capacity + draw(near), 0)
        width = max(shared_width, columns) if draw(st.integers(0, 4)) else columns + draw(st.integers(0, 3))
        view = torch.zeros(rows + draw(st.integers(0, 2)), width, dtype=dtype)[:rows, :columns]
        layout = draw(st.sampled_from(["rows"] * 8 + ["transposed", "1-D"]))
        if layout == "transposed":
            return view.t()
        return view.reshape(-1) if layout == "1-D" else view

    args = {
        "top_k_tokens": torch.zeros(top_k_shape, dtype=I32),
        "miss_src": plan_tensor("miss_src", [I64] * 5 + [I32]),
        "miss_dst": plan_tensor("miss_dst", [I32] * 5 + [I64]),
        "miss_count": plan_tensor("miss_count", [I32] * 5 + [I64]),
    }
    return speculative, args


@settings(max_examples=150, deadline=None)
@given(plan_calls())
def test_plan_guards_agree_with_checks(call):
    speculative, args = call
    check, fits = (check_spec_miss_plan, spec_miss_plan_fits) if speculative else (check_miss_plan, miss_plan_fits)
    try:
        check(**args)
        passed = True
    except ValueError:
        passed = False
    assert fits(**args) is passed


# --------------------------------------------------------------------------------------------------------------------
# Materialize


def check_mat(args):
    try:
        check_materialize(**args)
    except (TypeError, ValueError) as error:
        assert not materialize_fits(**args)
        return error
    assert materialize_fits(**args)
    return None


def expect_mat_error(args, spec_text, kind=ValueError):
    error = check_mat(args)
    assert isinstance(error, kind), f"expected {kind.__name__}, got {error!r}"
    assert_spec_message(error, spec_text)


def expect_mat_ok(args):
    assert check_mat(args) is None


def test_valid_materialize_passes():
    expect_mat_ok(mat_args())
    expect_mat_ok(mat_args(with_outputs=False))


@pytest.mark.parametrize("shape", [(T, 2 * H * D), (T, LYR, H, 2 * D), (T,)])
def test_kv_must_be_3d(shape):
    args = mat_args()
    args["kv"] = torch.zeros(shape)
    expect_mat_error(
        args,
        f"Invalid stacked fused KV projection shape: got {shape}, expected 3D [total_ctx, n_layers, kv_size*2].",
    )


def test_zero_tokens_checks_nothing_after_the_3d_check():
    args = mat_args(total_ctx=0)
    args.update(
        kv=torch.zeros(0, LYR, 7),
        rotary_dim=3,
        k_norm_weight=torch.zeros(1),
        eps=torch.zeros(5, 5),
        cos_sin_cache=torch.zeros(3),
        positions=torch.zeros(9),
        k_out=torch.zeros(1, dtype=torch.float64),
        v_out=torch.zeros(2, 2),
    )
    expect_mat_ok(args)
    args["kv"] = torch.zeros(0, 7)
    expect_mat_error(args, "Invalid stacked fused KV projection shape: got (0, 7), expected 3D")


def test_trailing_dim_is_two_heads_times_head_dim():
    args = mat_args()
    args["kv"] = torch.zeros(T, LYR, 2 * H * D + 2)
    expect_mat_error(
        args, f"Invalid fused KV projection shape: got {(T, LYR, 2 * H * D + 2)}, expected trailing dim {2 * H * D}."
    )
    args = mat_args()
    args["num_kv_heads"] = H + 1
    expect_mat_error(args, f"Invalid fused KV projection shape: got {(T, LYR, 2 * H * D)}, expected trailing dim")


@pytest.mark.parametrize("rotary", [0, -2, D + 2, 3, D - 1])
def test_rotary_dim(rotary):
    args = mat_args()
    args["rotary_dim"] = rotary
    expect_mat_error(args, f"Invalid fused KV rotary/head dim pair: rotary_dim={rotary}, head_dim={D}.")


@pytest.mark.parametrize("rotary", [2, D // 2, D])
def test_rotary_dim_boundaries_pass(rotary):
    expect_mat_ok(mat_args(rotary=rotary))


@pytest.mark.parametrize("shape", [(LYR, D - 1), (LYR + 1, D), (D,), (LYR, D, 1)])
def test_k_norm_weight_shape(shape):
    args = {**mat_args(), "k_norm_weight": torch.ones(shape)}
    expect_mat_error(
        args, f"Invalid stacked k_norm_weight shape for fused KV materialization: got {shape}, expected {(LYR, D)}."
    )


@pytest.mark.parametrize("shape", [(LYR + 1,), (), (LYR, 1)])
def test_eps_shape(shape):
    args = {**mat_args(), "eps": torch.zeros(shape)}
    expect_mat_error(args, f"Invalid stacked eps shape for fused KV materialization: got {shape}, expected {(LYR,)}.")


def test_eps_expected_shape_prints_as_one_tuple():
    args = {**mat_args(), "eps": torch.zeros(LYR + 1)}
    expect_mat_error(args, "Invalid stacked eps shape for fused KV materialization: got (3,), expected (2,).")


@pytest.mark.parametrize("shape", [(16, ROT - 2), (16 * ROT,), (16, ROT, 1)])
def test_cos_sin_cache_shape(shape):
    args = {**mat_args(), "cos_sin_cache": torch.zeros(shape)}
    expect_mat_error(
        args,
        f"Invalid cos_sin_cache shape for fused KV materialization: got {shape}, expected [max_pos, >= {ROT}].",
    )


def test_wider_cos_sin_cache_passes():
    expect_mat_ok({**mat_args(rotary=4), "cos_sin_cache": torch.zeros(16, D)})


def test_empty_cos_sin_cache_is_refused():
    with pytest.raises(ValueError, match="cos_sin_cache must have at least one position row"):
        check_materialize(**{**mat_args(), "cos_sin_cache": torch.zeros(0, ROT)})


@pytest.mark.parametrize(
    "positions, shown", [(torch.arange(T + 1), T + 1), (torch.arange(T - 1), T - 1), (torch.arange(T)[None], (1, T))]
)
def test_positions_match_token_count(positions, shown):
    args = {**mat_args(), "positions": positions}
    expect_mat_error(
        args, f"positions must match kv token count for fused KV materialization: positions={shown}, total_ctx={T}."
    )


def test_positions_may_live_anywhere_with_any_int_dtype():
    expect_mat_ok({**mat_args(), "positions": torch.empty(T, dtype=I32, device="meta")})
    expect_mat_ok({**mat_args(), "positions": torch.arange(T, dtype=torch.int16)})


def test_float_positions_are_refused():
    with pytest.raises(ValueError, match="positions must be an integer tensor .* got dtype=torch.float32"):
        check_materialize(**{**mat_args(), "positions": torch.zeros(T)})


@pytest.mark.parametrize("name", ["k_out", "v_out"])
@pytest.mark.parametrize("shape", [(LYR, T + 1, H, D), (T, LYR, H, D), (LYR, T, 2 * H * D)])
def test_output_shape(name, shape):
    args = {**mat_args(), name: torch.zeros(shape)}
    expect_mat_error(
        args,
        f"Invalid {name} shape for fused KV materialization: got {shape}, expected {(LYR, T, H, D)}.",
    )


def test_output_shape_prints_python_tuples():
    args = {**mat_args(total_ctx=7, n_layers=5, heads=8, dim=128, rotary=128), "k_out": torch.zeros(5, 7, 8, 64)}
    expect_mat_error(
        args, "Invalid k_out shape for fused KV materialization: got (5, 7, 8, 64), expected (5, 7, 8, 128)."
    )


@pytest.mark.parametrize("name", ["k_out", "v_out"])
@pytest.mark.parametrize("dtype, device", [(torch.float64, "cpu"), (torch.float32, "meta"), (torch.bfloat16, "meta")])
def test_output_device_dtype(name, dtype, device):
    args = {**mat_args(), name: torch.zeros(LYR, T, H, D, dtype=dtype, device=device)}
    expect_mat_error(
        args,
        f"Invalid {name} device/dtype for fused KV materialization: got device={device}, dtype={dtype}, "
        "expected device=cpu, dtype=torch.float32.",
    )


def test_outputs_with_free_strides_in_dims_0_to_2_pass():
    """Views of a pool slab with more context (and a padded head dim layout) pass; only the last dim is dense."""
    slab = torch.zeros(LYR, T + 5, H + 1, D)
    args = {**mat_args(), "k_out": slab[:, :T, :H], "v_out": torch.zeros(T, H, LYR, D).permute(2, 0, 1, 3)}
    expect_mat_ok(args)


def test_output_with_stepped_last_dim_is_refused():
    args = {**mat_args(), "v_out": torch.zeros(LYR, T, H, 2 * D)[..., ::2]}
    with pytest.raises(ValueError, match="v_out must have a unit stride in its last dim"):
        check_materialize(**args)


def test_eps_of_any_floating_dtype_passes():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        expect_mat_ok({**mat_args(), "eps": torch.zeros(LYR, dtype=dtype)})


def test_integer_eps_is_refused():
    with pytest.raises(ValueError, match="eps must be a floating tensor .* got dtype=torch.int64"):
        check_materialize(**{**mat_args(), "eps": torch.zeros(LYR, dtype=I64)})


@pytest.mark.parametrize("name", ["k_norm_weight", "eps", "cos_sin_cache"])
def test_small_tensors_must_be_on_kv_device(name):
    args = mat_args()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} must be on kv's device .* got device=meta, expected device=cpu"):
        check_materialize(**args)


@pytest.mark.parametrize("name", ["kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"])
@pytest.mark.parametrize("value", [None, [1.0], 2.0])
def test_materialize_non_tensor_is_type_error(name, value):
    args = {**mat_args(), name: value}
    expect_mat_error(args, f"{name} must be a torch.Tensor, got {type(value).__name__}", kind=TypeError)


@pytest.mark.parametrize("name", ["k_out", "v_out"])
def test_non_tensor_output_is_type_error(name):
    expect_mat_error({**mat_args(), name: [0.0]}, f"{name} must be a torch.Tensor or None, got list", kind=TypeError)


@pytest.mark.parametrize("name", ["num_kv_heads", "head_dim", "rotary_dim"])
@pytest.mark.parametrize("value", [True, 8.0, "8", None, torch.tensor(8)])
def test_dims_must_be_ints(name, value):
    expect_mat_error({**mat_args(), name: value}, f"{name} must be an int, got {type(value).__name__}", kind=TypeError)


@pytest.mark.parametrize("name", ["num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -1])
def test_heads_and_head_dim_below_one_meet_the_engines_list_first(name, value):
    """The engines' list runs first (a wrong H or D breaks its trailing-dim rule); at T == 0 nothing of it follows,
    so only a negative size, which no ``(n_layers, 0, H, D)`` output can take, is refused there."""
    trailing = "Invalid fused KV projection shape: got"
    expect_mat_error({**mat_args(), name: value}, trailing)
    expect_mat_error({**mat_args(), "kv": torch.zeros(4), name: value}, "Invalid stacked fused KV projection shape:")
    empty = {**mat_args(total_ctx=0, with_outputs=False), name: value}
    if value < 0:
        expect_mat_error(empty, f"{name} must be non-negative for fused KV materialization, got {value}.")
    else:
        expect_mat_ok(empty)


def test_zero_heads_fitting_the_list_is_refused_after_it():
    """``H == 0`` with ``kv`` of trailing dim 0 passes every rule of the list; kvplan's own check refuses it next."""
    args = mat_args(heads=0)
    assert args["kv"].shape[2] == 0
    expect_mat_error(args, "num_kv_heads must be positive for fused KV materialization, got 0.")


def test_materialize_type_errors_come_first():
    args = {**mat_args(), "kv": torch.zeros(5), "v_out": "x"}
    expect_mat_error(args, "v_out must be a torch.Tensor or None, got str", kind=TypeError)


@pytest.mark.parametrize("index", range(len(MAT_RULES)), ids=[rule[0] for rule in MAT_RULES])
def test_each_materialize_rule_alone(index):
    args = mat_args()
    MAT_RULES[index][1](args)
    error = check_mat(args)
    assert isinstance(error, ValueError)
    assert str(error).startswith(MAT_RULES[index][2])


def test_materialize_rules_report_the_earliest():
    for later in range(len(MAT_RULES)):
        for earlier in range(later):
            args = mat_args()
            MAT_RULES[later][1](args)
            MAT_RULES[earlier][1](args)
            error = check_mat(args)
            assert str(error).startswith(MAT_RULES[earlier][2]), (MAT_RULES[earlier][0], MAT_RULES[later][0])


def test_cuda_and_cuda_zero_are_one_device():
    assert _same_device(torch.device("cuda"), torch.device("cuda", 0)) == (
        not torch.cuda.is_available() or torch.cuda.current_device() == 0
    )
    assert _same_device(torch.device("cpu"), torch.device("cpu", 0))
    assert not _same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not _same_device(torch.device("cpu"), torch.device("meta"))


@pytest.mark.gpu
def test_outputs_on_the_gpu_pass_against_a_cuda_kv():
    args = {name: t.to("cuda") if isinstance(t, torch.Tensor) else t for name, t in mat_args().items()}
    args["positions"] = torch.arange(T)  # positions may stay on the host
    expect_mat_ok(args)
    args["k_out"] = torch.zeros(LYR, T, H, D)
    expect_mat_error(
        args,
        "Invalid k_out device/dtype for fused KV materialization: got device=cpu, dtype=torch.float32, "
        f"expected device={args['kv'].device}, dtype=torch.float32.",
    )


@st.composite
def materialize_calls(draw):
    total_ctx, n_layers = draw(st.integers(0, 3)), draw(st.integers(1, 3))
    heads, dim = draw(st.integers(1, 2)), draw(st.sampled_from([2, 4, 6]))
    rotary = draw(st.integers(-1, 8))

    def jitter(n):
        return max(0, n + draw(st.sampled_from([0, 0, 0, 0, -1, 1])))

    kv_shape = [jitter(total_ctx), n_layers, jitter(2 * heads * dim)]
    kv_shape = kv_shape[: draw(st.sampled_from([3, 3, 3, 3, 2]))]
    out_shape = (jitter(n_layers), jitter(total_ctx), heads, jitter(dim))
    return {
        "kv": torch.zeros(kv_shape),
        "k_norm_weight": torch.ones(jitter(n_layers), jitter(dim)),
        "eps": torch.zeros(jitter(n_layers)),
        "cos_sin_cache": torch.zeros(jitter(4), jitter(max(rotary, 0))),
        "positions": torch.zeros(jitter(total_ctx), dtype=draw(st.sampled_from([I64, I32, torch.float32]))),
        "num_kv_heads": heads,
        "head_dim": dim,
        "rotary_dim": rotary,
        "k_out": draw(st.sampled_from([None, torch.zeros(out_shape)])),
        "v_out": draw(
            st.sampled_from([None, torch.zeros(out_shape, dtype=draw(st.sampled_from([torch.float32, I32])))])
        ),
    }


@settings(max_examples=150, deadline=None)
@given(materialize_calls())
def test_materialize_guard_agrees_with_check(args):
    try:
        check_materialize(**args)
        passed = True
    except ValueError:
        passed = False
    assert materialize_fits(**args) is passed
