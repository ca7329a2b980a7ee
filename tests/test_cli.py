"""The command line: demo (checked against the reference), plan (bytes per policy), bench (argument handling)."""

import json

import pytest

from kvplan import PoolConfig, required_bytes
from kvplan.cli import main


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "plan", "bench"):
        assert command in out


def test_demo_runs_checked_and_plots(tmp_path, capsys):
    plot = tmp_path / "pool.png"
    assert main(["demo", "--steps", "8", "--seed", "3", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "all 8 steps equal the reference" in out
    assert "sparse attention: all 8 steps exact" in out
    assert "growth timeline" in out
    assert plot.stat().st_size > 1000


def test_demo_prints_the_prometheus_exposition(capsys):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    assert main(["demo", "--steps", "3", "--check", "off", "--metrics"]) == 0
    out = capsys.readouterr().out
    exposition = out[out.index("# HELP kvplan_pool_") :]
    families = {family.name: family for family in text_string_to_metric_families(exposition)}
    assert families["kvplan_pool_device_events"].type == "counter"
    assert families["kvplan_pool_buffer_reserved_bytes"].type == "gauge"
    assert any(s.value > 0 for s in families["kvplan_pool_reserved_bytes"].samples)


def test_demo_rejects_bad_shapes(capsys):
    # top_k above the hot buffer cannot run (HOT >= K): a clear message, exit status 2
    assert main(["demo", "--steps", "1", "--hot", "4", "--top-k", "8"]) == 2
    assert "top_k_choices must be <= hot" in capsys.readouterr().err


def test_plan_json_matches_required_bytes(capsys):
    args = ["plan", "--batch", "8", "--steps", "4", "--top-k", "64", "--ctx", "128", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    import torch

    from kvplan import MaterializeGeometry

    geometry = MaterializeGeometry(5, 8, 128, torch.bfloat16)
    exact = required_bytes(PoolConfig(growth="exact"), geometry, batch=8, num_steps=4, top_k=64, total_ctx=128)
    assert result["reserve"]["total"] == exact
    geometric = required_bytes(
        PoolConfig(), geometry, batch=8, num_steps=4, top_k=64, total_ctx=128, worst_case_growth=True
    )
    assert result["geometric x2"]["total"] == geometric
    assert set(result) == {"reserve", "exact", "geometric x2", "bucketed"}


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--top-k", "0"], ["demo", "--spec-steps", "x"]])
def test_demo_argument_errors_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--batch", "-1"], "required_bytes: batch must be >= 0"),
        (["plan", "--growth-factor", "1"], "PoolConfig.growth_factor"),
        (["demo", "--max-len", "3", "--steps", "1"], "LoopConfig.max_len must leave room"),
        (["demo", "--device", "nonsense"], "is not a torch device"),
    ],
)
def test_library_errors_become_exit_status_2_with_the_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_required_bytes_names_a_wrong_config_type():
    with pytest.raises(TypeError, match="config must be a PoolConfig or None, got dict"):
        required_bytes({"growth": "exact"}, batch=1)


def test_plain_text_fallback_without_rich(monkeypatch, capsys):
    import sys

    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich -> ImportError
    assert main(["plan", "--batch", "8", "--top-k", "64"]) == 0
    assert main(["demo", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "miss_src" in captured.out and "geometric x2" in captured.out
    assert "┃" not in captured.out  # no rich box drawing: the plain aligned table
    assert "all 3 steps equal the reference" in captured.out
    assert "step 3/3" in captured.err  # the plain progress line
