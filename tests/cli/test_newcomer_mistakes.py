"""A newcomer's mistakes outside the step itself: each is refused where it is first stated, in kvplan's words, naming
the fix (Triton's interpreter switched on too late, a CUDA state without a GPU, hot < top_k), and what a newcomer
expects of the tools works (``--version``, the reference taking ``eps`` as the pool does)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvplan import HotBufferState, PlanBufferPool, __version__, reference
from kvplan.cli import main


def test_triton_interpret_set_after_importing_the_kernels_is_named():
    """Triton reads TRITON_INTERPRET when it decorates a kernel: set later, a CPU launch names the fix instead of
    failing 15 frames inside Triton (``0 active drivers``)."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels are compiled: the late switch is only a CPU mistake")
    script = textwrap.dedent(
        """
        import os, torch
        import kvplan.kernels
        os.environ["TRITON_INTERPRET"] = "1"  # too late
        from kvplan import HotBufferState, PlanBufferPool, kernels
        for launch in ("swap_in", "materialize"):
            try:
                if launch == "swap_in":
                    state = HotBufferState.allocate(1, hot=8, tail=2, max_len=64)
                    pool = PlanBufferPool("cpu")
                    pool.ensure_capacity(batch=1, top_k=4)
                    tokens = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
                    pool.swap_in(state, tokens, torch.empty_like(tokens), torch.tensor([0]), torch.tensor([5]),
                                 torch.randn(64, 1), torch.zeros(state.device_rows, 1))
                else:
                    kernels.materialize(torch.randn(3, 2, 32), torch.ones(2, 16), torch.full((2,), 1e-6),
                                        torch.randn(8, 16), torch.arange(3), num_kv_heads=1, head_dim=16,
                                        rotary_dim=16)
            except ValueError as error:
                print(launch, error)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["swap_in", "materialize"], result.stdout + result.stderr[-2000:]
    for line in lines:
        assert "TRITON_INTERPRET=1 is set, but it was set after kvplan.kernels was imported" in line
        assert "Set TRITON_INTERPRET=1 before kvplan.kernels (or kvplan.ops) is first imported" in line


def test_a_cuda_state_without_a_gpu_is_refused_in_kvplans_words():
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    want = "names CUDA device" if torch.cuda.is_available() else "needs CUDA, but no CUDA device is available"
    with pytest.raises(ValueError, match=rf"^HotBufferState.allocate: device='{device}' {want}"):
        HotBufferState.allocate(1, hot=8, tail=2, max_len=64, device=device)
    with pytest.raises(ValueError, match=want):  # as the pool says it
        PlanBufferPool(device)


def test_hot_below_top_k_is_refused_where_it_is_first_stated(capsys):
    with pytest.raises(ValueError, match=r"hot must be at least top_k: .* got hot = 8, top_k = 16"):
        HotBufferState.allocate(1, hot=8, tail=2, max_len=64, steps=1, top_k=16)
    HotBufferState.allocate(1, hot=16, tail=2, max_len=64, steps=1, top_k=16)  # hot == top_k: fine
    assert main(["plan", "--hot", "8", "--top-k", "2048"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table for a state that cannot run
    assert captured.err == (
        "kvplan plan: --hot: expected at least --top-k = 2048 hot slots (a request's top-k is resolved into its hot "
        "slots: HotBufferState.allocate and every swap-in refuse hot < top_k), got 8\n"
    )
    assert main(["plan", "--hot", "2048", "--top-k", "2048"]) == 0


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"kvplan {__version__}\n"


def test_the_reference_takes_eps_as_the_pool_does():
    torch.manual_seed(0)
    kv, weight, cache, positions = torch.randn(3, 2, 32), torch.rand(2, 16) + 0.5, torch.randn(8, 16), torch.arange(3)
    want = reference.materialize(kv, weight, torch.full((2,), 1e-6), cache, positions, 1, 16, 16)
    for eps in (1e-6, [1e-6, 1e-6]):
        got = reference.materialize(kv, weight, eps, cache, positions, 1, 16, 16)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="eps must be > 0 and finite"):
        reference.materialize(kv, weight, -1.0, cache, positions, 1, 16, 16)
