"""The command line: demo (checked against the reference), plan (bytes per policy), bench (argument handling)."""

import json
import re
import sys

import pytest

from kvplan import PoolConfig, required_bytes
from kvplan.cli import main


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "plan", "bench"):
        assert command in out


@pytest.mark.slow  # the checked demo under the interpreter, with a plot
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
    assert capsys.readouterr().err == (
        "kvplan demo: --top-k: expected values <= --hot (4: a request's top-k is resolved into its hot slots), got 8\n"
    )


def test_plan_json_matches_required_bytes(capsys):
    args = ["plan", "--batch", "8", "--steps", "4", "--top-k", "64", "--total-ctx", "128", "--json"]
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
    assert set(result) == {"reserve", "geometric x2", "bucketed"}  # exact growth reaches reserve's figure: one column
    worst_exact = required_bytes(
        PoolConfig(growth="exact"), geometry, batch=8, num_steps=4, top_k=64, total_ctx=128, worst_case_growth=True
    )
    assert worst_exact == exact


@pytest.mark.parametrize("item_bytes", [None, 1152])
def test_plan_sizes_the_engine_device_buffer_as_the_state_does(item_bytes, capsys):
    """Issue 28, item 6: --hot/--tail/--item-bytes give HotBufferState.allocate(...).device_rows, scratch included."""
    from kvplan import HotBufferState

    argv = ["plan", "--batch", "3", "--steps", "3", "--top-k", "8", "--hot", "16", "--tail", "4", "--json"]
    argv += [] if item_bytes is None else ["--item-bytes", str(item_bytes)]
    assert main(argv) == 0
    device = json.loads(capsys.readouterr().out)["device_buffer"]
    state = HotBufferState.allocate(3, hot=16, tail=4, max_len=8, steps=3, top_k=8)
    assert device["scratch_rows"] == state.scratch == 8 and device["device_rows"] == state.device_rows == 3 * 28
    assert device.get("bytes") == (None if item_bytes is None else state.device_rows * item_bytes)
    assert main([a for a in argv if a != "--json"]) == 0  # the table: the rows, the scratch rule and the bytes
    out = capsys.readouterr().out
    assert "scratch_rows(16, 3, 8)" in out and "84" in out
    assert ("give --item-bytes" in out) == (item_bytes is None)


def test_plan_device_buffer_defaults_tail_to_steps_and_requests_to_batch(capsys):
    assert main(["plan", "--batch", "5", "--steps", "2", "--top-k", "4", "--hot", "8", "--json"]) == 0
    device = json.loads(capsys.readouterr().out)["device_buffer"]
    assert (device["num_reqs"], device["tail"], device["scratch_rows"], device["device_rows"]) == (5, 2, 0, 50)
    assert main(["plan", "--json"]) == 0
    assert "device_buffer" not in json.loads(capsys.readouterr().out)


def test_plan_buckets_below_the_batch_are_said_to_grow_geometrically(capsys):
    assert main(["plan", "--batch", "64", "--buckets", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "bucketed (geometric past 8)" in out
    assert "note: --batch 64 is above the largest bucket 8: past it the bucketed policy grows the batch rows " in out
    assert main(["plan", "--batch", "8", "--buckets", "1,2,4,8"]) == 0
    assert "geometric past" not in capsys.readouterr().out
    assert main(["plan", "--batch", "64", "--buckets", "1,2,4,8", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # the note goes to stderr: stdout stays JSON
    assert captured.err.startswith("kvplan plan: note: --batch 64 is above the largest bucket 8")


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
        (["plan", "--batch", "-1"], "--batch: expected an integer >= 0 (the largest batch), got -1"),
        (["plan", "--growth-factor", "1"], "--growth-factor: expected a finite number > 1"),
        (["demo", "--max-len", "3", "--steps", "1"], "--max-len: expected >= 2 x 4 + 3 = 11 for --spec-steps up to 4"),
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
    # not a terminal: one line per progress report, never "step 1/3step 2/3" run together
    assert [line for line in captured.err.splitlines() if "step" in line] == ["step 1/3", "step 2/3", "step 3/3"]


# ---- issue 22, item 7: refusals name the flag as typed, what it expects and what was given ---------------------------

INTERNAL_NAMES = ("LoopConfig", "required_bytes", "PoolConfig", "MaterializeGeometry", "top_k_choices", "num_steps")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["demo", "--steps", "0"], "kvplan demo: --steps: expected an integer >= 1 (decode steps to simulate), got 0"),
        (
            ["demo", "--top-k", "32"],
            "kvplan demo: --top-k: expected values <= --hot (16: a request's top-k is resolved into its hot slots), "
            "got 32",
        ),
        (
            ["demo", "--top-k", "4,32", "--hot", "8"],
            "kvplan demo: --top-k: expected values <= --hot (8: a request's "
            "top-k is resolved into its hot slots), got 4,32",
        ),  # fmt: skip
        (
            ["demo", "--max-batch", "0"],
            "kvplan demo: --max-batch: expected an integer >= 1 (requests running at once), got 0",
        ),  # fmt: skip
        (
            ["demo", "--hot", "0", "--top-k", "1"],
            "kvplan demo: --hot: expected an integer >= 1 (hot-buffer slots per request), got 0",
        ),  # fmt: skip
        (
            ["demo", "--max-len", "-5"],
            "kvplan demo: --max-len: expected an integer >= 1 (the longest context in tokens), got -5",
        ),  # fmt: skip
        (
            ["demo", "--seed", "-1"],
            "kvplan demo: --seed: expected an integer in [0, 2**64) (a torch.Generator seed), got -1",
        ),  # fmt: skip
        (
            ["demo", "--scratch", "-1"],
            "kvplan demo: --scratch: expected an integer >= 0 (scratch rows per request), got -1",
        ),  # fmt: skip
        (
            ["demo", "--attention-batch", "0"],
            "kvplan demo: --attention-batch: expected an integer >= 1 (requests of the sparse-attention check), got 0",
        ),  # fmt: skip
        (
            ["demo", "--spec-steps", "1,9"],
            "kvplan demo: --max-len: expected >= 2 x 9 + 3 = 21 for --spec-steps up to 9 "
            "(room for a request to grow by its drafts), got 20",
        ),  # fmt: skip
        (["plan", "--batch", "-1"], "kvplan plan: --batch: expected an integer >= 0 (the largest batch), got -1"),
        (
            ["plan", "--steps", "0"],
            "kvplan plan: --steps: expected an integer >= 1 (the most speculative steps), got 0",
        ),  # fmt: skip
        (["plan", "--top-k", "-2"], "kvplan plan: --top-k: expected an integer >= 0 (the largest top_k), got -2"),
        (
            ["plan", "--total-ctx", "-1"],
            "kvplan plan: --total-ctx: expected an integer >= 0 (draft tokens materialized "
            "per step; 0: no slabs), got -1",
        ),  # fmt: skip
        (["plan", "--layers", "0"], "kvplan plan: --layers: expected an integer >= 1 (draft model layers), got 0"),
        (
            ["plan", "--kv-heads", "-1"],
            "kvplan plan: --kv-heads: expected an integer >= 1 (draft model KV heads), got -1",
        ),  # fmt: skip
        (
            ["plan", "--head-dim", "0"],
            "kvplan plan: --head-dim: expected an integer >= 1 (draft model head dim), got 0",
        ),  # fmt: skip
        (
            ["plan", "--growth-factor", "0.5"],
            "kvplan plan: --growth-factor: expected a finite number > 1 (the geometric growth factor), got 0.5",
        ),  # fmt: skip
        (
            ["plan", "--buckets", "8,4"],
            "kvplan plan: --buckets: expected increasing CUDA-graph batch sizes (e.g. "
            "1,2,4,8,16,32,64,128,256), got '8,4'",
        ),
        (
            ["plan", "--buckets", "4,4"],
            "kvplan plan: --buckets: expected increasing CUDA-graph batch sizes (e.g. "
            "1,2,4,8,16,32,64,128,256), got '4,4'",
        ),
        (["plan", "--tail", "4"], "kvplan plan: --tail: sizes the device buffer, which needs --hot"),
        (
            ["plan", "--hot", "0"],
            "kvplan plan: --hot: expected an integer in [1, 32769) (hot slots per request), got 0",
        ),
        (
            ["plan", "--hot", "8", "--item-bytes", "0"],
            "kvplan plan: --item-bytes: expected an integer >= 1 (bytes of one device-buffer row), got 0",
        ),
        (
            ["plan", "--buckets", "4,0"],
            "kvplan plan: --buckets: expected comma-separated CUDA-graph batch sizes >= 1 "
            "(e.g. 1,2,4,8,16,32,64,128,256), got '4,0'",
        ),  # fmt: skip
    ],
)
def test_refusals_name_the_flag_what_it_expects_and_what_was_given(argv, line, capsys):
    if argv[0] == "demo" and "--spec-steps" in argv:
        argv = [*argv, "--max-len", "20"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n"
    assert not any(name in captured.err for name in INTERNAL_NAMES)
    assert "decode steps on" not in captured.out  # refused before the work started


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["demo", "--steps", "x"], "kvplan demo: --steps: expected an integer, got 'x' (see kvplan demo --help)"),
        (
            ["demo", "--top-k", "0"],
            "kvplan demo: --top-k: expected positive integers, got '0' (see kvplan demo --help)",
        ),  # fmt: skip
        (
            ["plan", "--growth-factor", "fast"],
            "kvplan plan: --growth-factor: expected a number, got 'fast' (see kvplan plan --help)",
        ),  # fmt: skip
        (["demo", "--nope"], "kvplan demo: unrecognized arguments: --nope (see kvplan demo --help)"),
        (["plan", "--growth", "exact"], "kvplan plan: unrecognized arguments: --growth exact (see kvplan plan --help)"),
    ],
)
def test_argument_syntax_errors_are_one_line_naming_the_flag(argv, line, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_plan_help_shows_defaults_and_what_total_ctx_is(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split("options:")[1].split())  # argparse wraps at the terminal width
    for flag, default in [("--batch", "64"), ("--steps", "4"), ("--top-k", "2048"), ("--layers", "5"),
                          ("--kv-heads", "8"), ("--head-dim", "128"), ("--dtype", "bf16"),
                          ("--buckets", "1,2,4,8,16,32,64,128,256"), ("--growth-factor", "2.0")]:  # fmt: skip
        # the flag's own help (up to the next option) ends with its default
        assert re.search(rf"{flag} \S+ (?:(?! --[a-z]).)*?\(default: {re.escape(default)}\)", text), (flag, text)
    assert "--total-ctx TOKENS most draft tokens whose KV one step materializes" in text
    assert "not the sequence context" in text and "(default: 0, no slabs)" in text
    assert "--ctx" not in text  # the alias of an unreleased 0.1 is gone


def test_demo_and_bench_help_show_defaults(capsys):
    for command in ("demo", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--steps STEPS decode steps to simulate (default: 40 on a GPU, 24 on a CPU, where Triton's interpreter runs "
        "the kernels)"
    ) in text
    assert "--scratch ROWS scratch rows per request" in text and "kvplan.sizing.scratch_rows(--hot, the largest" in text
    assert "--attention-batch N requests of the end-to-end sparse-attention check" in text
    assert "(default: 4 on a GPU, 2 on a CPU, at most --max-batch)" in text
    assert "(default: 4,8)" in text and "(default: geometric)" in text and "(default: auto)" in text
    assert "(default: out)" in text  # bench --out-dir
    assert "(default: None)" not in text and "(default: False)" not in text


def test_ctx_is_refused_and_total_ctx_sizes_the_slabs(capsys):
    base = ["plan", "--batch", "8", "--steps", "4", "--top-k", "64", "--json"]
    assert main([*base, "--total-ctx", "128"]) == 0
    planned = capsys.readouterr()
    assert planned.err == "" and json.loads(planned.out)["reserve"]["k_out"] > 0
    with pytest.raises(SystemExit) as refused:
        main([*base, "--ctx", "128"])
    assert refused.value.code == 2
    assert "kvplan plan: unrecognized arguments: --ctx 128" in capsys.readouterr().err


@pytest.mark.parametrize("growth", ["exact", "geometric", "bucketed"])
def test_demo_runs_every_growth_policy_of_the_pool(growth, capsys):
    from kvplan.cli.demo import GROWTH_POLICIES as DEMO_POLICIES
    from kvplan.config import GROWTH_POLICIES

    assert DEMO_POLICIES == GROWTH_POLICIES  # every policy the pool has
    assert main(["demo", "--steps", "3", "--max-batch", "5", "--growth", growth]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    expected = "growth bucketed (batch buckets 1,2,4,8);" if growth == "bucketed" else f"growth {growth};"
    assert expected in header, header
    assert "all 3 steps equal the reference" in out


def test_loop_config_takes_a_bucketed_pool_from_its_graph_batches():
    """LoopConfig(growth='bucketed'): the pool's buckets are the batch sizes the loop launches (the powers of two up
    to the padded max batch; every batch without graph padding), no pool swapped in afterwards."""
    from kvplan.testing.simulation import DecodeLoop, LoopConfig

    config = LoopConfig(max_batch=5, num_reqs=7, growth="bucketed")
    assert config.batch_buckets == (1, 2, 4, 8)
    loop = DecodeLoop(config, "cpu")
    assert loop.pool.config.growth == "bucketed" and loop.pool.config.batch_buckets == (1, 2, 4, 8)
    loop.pool.ensure_capacity(batch=3, num_steps=1, top_k=4)
    assert loop.pool.stats().as_dict()["miss_count.capacity.batch"] == 4
    assert LoopConfig(max_batch=1, num_reqs=3, growth="bucketed").pool_config().batch_buckets == (1,)
    assert LoopConfig(max_batch=5, num_reqs=7, graph_pad=False).batch_buckets == (1, 2, 3, 4, 5)
    for growth in ("exact", "geometric"):  # the other policies take no buckets
        assert LoopConfig(growth=growth).pool_config().batch_buckets == ()
    with pytest.raises(ValueError, match=r"^LoopConfig.growth must be one of 'exact', 'geometric', 'bucketed', got "
                       r"'buckets'$"):  # fmt: skip
        LoopConfig(growth="buckets")


def test_demo_bucketed_pool_comes_from_loop_config(capsys):
    import kvplan.cli.demo as demo

    assert not hasattr(demo, "_bucketed_pool")  # the workaround is gone: LoopConfig builds the bucketed pool
    assert main(["demo", "--steps", "2", "--check", "off", "--max-batch", "3", "--growth", "bucketed"]) == 0
    assert "growth bucketed (batch buckets 1,2,4);" in capsys.readouterr().out


# ---- issue 22, item 1: the demo's scratch rows are sized so that nothing overflows -----------------------------------


def test_loop_scratch_rows_follow_the_sizing_rule():
    from kvplan.sizing import scratch_rows
    from kvplan.testing.simulation import DecodeLoop, LoopConfig

    config = LoopConfig()  # spec steps up to 4, top_k up to 8, hot 16
    assert config.scratch is None and config.scratch_rows == config.scratch_rule == scratch_rows(16, 4, 8) == 16
    assert not config.can_overflow
    assert DecodeLoop(config, "cpu").state.scratch_locs.shape == (config.num_reqs, 16)
    wide = LoopConfig(hot=32, top_k_choices=(4, 8))  # 4 x 8 - 32: no scratch rows needed
    assert wide.scratch_rows == 0 and DecodeLoop(wide, "cpu").state.scratch_locs is None
    given = LoopConfig(scratch=4)
    assert given.scratch_rows == 4 and given.scratch_rule == 16 and given.can_overflow
    assert DecodeLoop(given, "cpu").state.scratch_locs.shape == (given.num_reqs, 4)
    assert not LoopConfig(scratch=20).can_overflow


SCRATCH_WARNING = (
    "kvplan demo: warning: --scratch 2 is below the 16 scratch rows per request with which no speculative swap-in "
    "overflows (kvplan.sizing.scratch_rows(16, 4, 8): --spec-steps up to 4 x --top-k up to 8 - --hot 16); misses past "
    "them come back as -1, counted as overflow"
)


def test_demo_sizes_scratch_so_nothing_overflows_and_warns_below_the_rule(capsys):
    """Every step at 4 draft steps x top_k 8 over 16 hot slots: with the rule's 16 scratch rows nothing overflows
    (the summary says 0); --scratch 2 warns once, before the run, and the same schedule then overflows."""
    argv = ["demo", "--steps", "4", "--seed", "1", "--spec-steps", "4", "--top-k", "8", "--attention-batch", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning") == 0
    assert "scratch 16 rows per request (= kvplan.sizing.scratch_rows(16, 4, 8): no swap-in can overflow)" in (
        captured.out
    )
    assert (
        "overflow: 0 speculative misses dropped (decode loop: counters.overflow = 0; sparse-attention check: 0); 16 "
        "scratch rows per request = kvplan.sizing.scratch_rows(16, 4, 8), so none can\n"
    ) in captured.out
    assert "overflow=0" in captured.out

    assert main([*argv, "--scratch", "2"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if line.startswith("kvplan demo:")] == [SCRATCH_WARNING]
    line = next(line for line in captured.out.splitlines() if line.startswith("overflow: "))
    dropped = int(line.split()[1])
    assert dropped > 0, line
    assert line.endswith("2 scratch rows per request (--scratch), below the 16 of kvplan.sizing.scratch_rows(16, 4, 8)")
    assert "all 4 steps equal the reference" in captured.out  # overflow is the contract's outcome, not a mismatch


def test_demo_warns_nothing_at_or_above_the_rule(capsys):
    assert main(["demo", "--steps", "1", "--check", "off", "--scratch", "16"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert "overflow: 0 speculative misses dropped (decode loop: counters.overflow = 0); 16 scratch" in captured.out


def test_demo_fails_when_misses_overflow_although_the_rule_holds(capsys):
    """The summary's overflow line is a check: nothing may overflow with the rule's scratch rows."""
    from kvplan.cli.demo import _report_overflow
    from kvplan.testing.simulation import LoopConfig

    class Stats:
        def as_dict(self):
            return {"counters.overflow": 3}

    assert _report_overflow(LoopConfig(), Stats(), []) is False
    captured = capsys.readouterr()
    assert captured.out.startswith("overflow: 3 speculative misses dropped (decode loop: counters.overflow = 3); ")
    assert captured.err == (
        "kvplan demo: OVERFLOW: 3 misses dropped with 16 scratch rows per request, which "
        "kvplan.sizing.scratch_rows(16, 4, 8) says none can\n"
    )
    assert _report_overflow(LoopConfig(scratch=2), Stats(), []) is True  # below the rule: warned, reported, not failed


# ---- issue 22, item 9: on a CPU the demo's defaults are sized for Triton's interpreter -------------------------------


def test_demo_defaults_on_a_cpu_are_sized_for_the_interpreter(monkeypatch, capsys):
    """24 steps (40 on a GPU) and a 2-request sparse-attention check (4 on a GPU), said in the output; the run is cut
    to 2 steps here to stay fast."""
    from kvplan.cli.demo import DEVICE_DEFAULTS
    from kvplan.testing import simulation

    assert DEVICE_DEFAULTS == {"cuda": {"steps": 40, "attention_batch": 4}, "cpu": {"steps": 24, "attention_batch": 2}}
    monkeypatch.setattr(simulation.DecodeLoop, "run", lambda self: (self.step(i) for i in range(2)))
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kvplan demo: 24 decode steps on cpu (Triton interpreter on the CPU)")
    assert "end-to-end check: a sparse-attention step on 2 requests after every decode step" in out
    assert (
        "CPU defaults (Triton's interpreter runs every kernel program in turn): --steps 24, --attention-batch 2; on a "
        "GPU --steps 40, --attention-batch 4"
    ) in out
    assert main(["demo", "--device", "cpu", "--steps", "2", "--attention-batch", "3"]) == 0  # given: no defaults line
    out = capsys.readouterr().out
    assert "CPU defaults" not in out and "sparse-attention step on 3 requests" in out
    assert "sparse attention: all 2 steps exact" in out
    assert main(["demo", "--device", "cpu", "--steps", "2", "--check", "off"]) == 0  # no check: no attention batch
    out = capsys.readouterr().out
    assert "CPU defaults (Triton's interpreter runs every kernel program in turn): --steps 2" not in out
    assert "end-to-end check" not in out and "CPU defaults" not in out


# ---- issue 22, item 10: the plot, one panel per unit, every line visible, legends off the data --------------------


def test_demo_runs_on_one_thread_on_a_cpu_and_gives_the_threads_back(monkeypatch, capsys):
    """On a CPU the demo's tensors are tiny and the interpreter single-threaded: torch's intra-op threads only spin
    when another process holds the other core. One thread during the run, the caller's count after it."""
    import torch

    from kvplan.testing import simulation

    seen = []
    step = simulation.DecodeLoop.step

    def counting(self, i, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, i, **kwargs)

    monkeypatch.setattr(simulation.DecodeLoop, "step", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["demo", "--device", "cpu", "--steps", "2", "--check", "off"]) == 0
        assert seen == [1, 1] and torch.get_num_threads() == 2
        assert main(["demo", "--device", "cpu", "--steps", "0"]) == 2  # refused: the threads given back too
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def _records(steps: int = 6):
    from kvplan.testing.simulation import DecodeLoop, LoopConfig

    return list(DecodeLoop(LoopConfig(steps=steps, seed=3), "cpu").run())


def test_plot_panels_have_one_unit_each_and_legends_outside_the_data():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvplan.cli.demo import _figure

    records = _records()
    fig = _figure(records)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the constrained layout places the legends
    renderer = canvas.get_renderer()
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == [
        "reserved (bytes)", "batch (rows)", "miss plan (entries)", "draft KV (tokens)"
    ]  # fmt: skip
    for ax in axes:
        legend = ax.get_legend()
        assert legend is not None
        box, frame = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.x0 >= frame.x1, (ax.get_ylabel(), box, frame)  # right of the axes: covers no line
        assert box.x1 <= fig.bbox.x1 + 1  # and inside the figure
    # k_out and v_out reserve the same bytes at every step: one line that says so, every line its own style
    bytes_ax = axes[0]
    *labels, growth = [line.get_label() for line in bytes_ax.get_lines() if line.get_label()[0] != "_"]
    assert growth == "growth (ensure_capacity\ngrew)"
    assert "k_out = v_out" in labels and "k_out" not in labels and "v_out" not in labels
    assert sorted(labels) == sorted(["miss_src", "miss_dst", "miss_count", "workspace", "k_out = v_out"])
    styles = [(line.get_linestyle(), line.get_marker()) for line in bytes_ax.get_lines()[: len(labels)]]
    assert len(set(styles)) == len(styles)
    assert [t.get_text() for t in bytes_ax.get_legend().get_texts()][: len(labels)] == labels
    # issue 28, item 7: capacity and demand are two lines per panel; capacity never shrinks (it does not follow the
    # step's shape), every step's demand is under it, and every panel marks the steps where the pool grew
    batch_ax, columns_ax, tokens_ax = axes[1:]
    demands = {
        batch_ax: [r.padded_batch for r in records],
        columns_ax: [r.padded_batch * r.num_steps * r.top_k for r in records],
        tokens_ax: [r.total_ctx for r in records],
    }
    for ax, demand in demands.items():
        capacity_line, demand_line = ax.get_lines()[:2]
        assert capacity_line.get_label().startswith("capacity") and demand_line.get_label().startswith("demand")
        capacity, wanted = list(capacity_line.get_ydata()), list(demand_line.get_ydata())
        assert wanted == demand and all(w <= c for w, c in zip(wanted, capacity))
        assert capacity == sorted(capacity) and len(set(capacity)) > 1  # grows, never swings back
    grew = [r.step for r in records if r.grew]
    assert grew and len(grew) < len(records)
    for ax in axes:
        marks = [line for line in ax.get_lines() if line.get_linestyle() == ":" and line.get_color() == "0.4"]
        assert sorted(line.get_xdata()[0] for line in marks) == grew, ax.get_ylabel()
        assert "growth (ensure_capacity\ngrew)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_groups_only_buffers_whose_bytes_are_equal_at_every_step():
    import attrs

    from kvplan.cli.demo import _figure

    records = _records(3)
    records[-1] = attrs.evolve(records[-1], reserved_bytes={**records[-1].reserved_bytes, "v_out": 1 << 20})
    labels = [line.get_label() for line in _figure(records).axes[0].get_lines()]
    assert "k_out" in labels and "v_out" in labels and "k_out = v_out" not in labels


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_plain_progress_ends_its_lines(tty, monkeypatch):
    import sys

    from kvplan.cli import demo

    monkeypatch.setitem(sys.modules, "rich.progress", None)  # no rich: the plain fallback
    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(demo._progress(iter(range(25)), 25)) == list(range(25))
    if tty:  # one line rewritten in place, ended once
        assert stream.text == "".join(f"\rstep {i}/25" for i in range(1, 26)) + "\n"
    else:  # a line every tenth of the run and the last one
        assert stream.text.splitlines() == [f"step {i}/25" for i in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25)]
        assert stream.text.endswith("\n") and "\r" not in stream.text


def test_demo_without_numpy_says_the_interpreter_needs_it(monkeypatch, capsys):
    """Triton's interpreter needs numpy: without it the demo is refused in one line naming numpy (not a traceback
    chained under rich's ImportError)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU does not use the interpreter")
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy -> ImportError
    assert main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvplan demo: Triton's interpreter (used without a CUDA GPU) needs numpy, which is not installed: "
        "pip install numpy\n"
    )


def test_plain_progress_does_not_chain_a_step_error_to_rich(monkeypatch):
    """Without rich, an error raised by a step carries no "during handling of ImportError('rich')" context."""
    from kvplan.cli.demo import _progress

    monkeypatch.setitem(sys.modules, "rich.progress", None)

    def steps():
        yield 1
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed") as exc:
        list(_progress(steps(), 2))
    assert exc.value.__context__ is None
