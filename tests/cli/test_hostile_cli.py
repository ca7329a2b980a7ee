"""The command line with hostile arguments: one clear line on stderr and exit status 2 (before any work starts),
or a correct result; never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvplan.cli import main
from kvplan.testing.simulation import DecodeLoop, LoopConfig

HUGE = str(10**40)


def _file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--growth-factor", "nan"], r"^kvplan plan: --growth-factor: expected a finite number > 1 .* nan$"),
        (["plan", "--growth-factor", "inf"], r"^kvplan plan: --growth-factor: expected a finite number > 1 .* inf$"),
        (["plan", "--growth-factor=-inf"], r"--growth-factor: expected a finite number > 1 .*, got -inf$"),
        (["plan", "--steps", "0"], r"^kvplan plan: --steps: expected an integer >= 1 .*, got 0$"),
        (["plan", "--total-ctx", "5", "--layers", "0"], r"^kvplan plan: --layers: expected an integer >= 1 .*, got 0$"),
        (
            ["plan", "--buckets", ","],
            r"^kvplan plan: --buckets: expected comma-separated CUDA-graph batch sizes .*, "
            r"got ','$",
        ),  # fmt: skip
        (["plan", "--buckets", "1,x"], r"^kvplan plan: --buckets: expected .*, got '1,x'$"),
        (
            ["demo", "--max-batch", "99999999999"],
            r"^kvplan demo: --max-batch 99999999999, --max-len 160, --hot 16: "
            r"expected tables that fit this machine's .* GiB of host memory, got .* GiB; lower --max-batch",
        ),  # fmt: skip
        (
            ["demo", "--seed", str(10**23)],
            r"^kvplan demo: --seed: expected an integer in \[0, 2\*\*64\) .*, got " + str(10**23) + "$",
        ),  # fmt: skip
        (["demo", "--seed", "-1"], r"^kvplan demo: --seed: expected an integer in \[0, 2\*\*64\) .*, got -1$"),
        (
            ["demo", "--max-len", HUGE],
            rf"^kvplan demo: --max-batch 6, --max-len {HUGE}, --hot 16: expected tables "
            "that fit",
        ),  # fmt: skip
        (
            ["demo", "--hot", str(2**40), "--top-k", "4"],
            rf"^kvplan demo: --max-batch 6, --max-len 160, --hot {2**40}: "
            "expected tables that fit",
        ),  # fmt: skip
        (
            ["demo", "--scratch", HUGE],
            rf"^kvplan demo: --max-batch 6, --max-len 160, --hot 16, --scratch {HUGE}: "
            "expected tables that fit .*; lower --max-batch, --max-len, --hot or --scratch$",
        ),  # fmt: skip
        (
            ["demo", "--spec-steps", str(10**6)],
            r"^kvplan demo: --max-len: expected >= 2 x 1000000 \+ 3 = 2000003 for "
            r"--spec-steps up to 1000000 .*, got 160$",
        ),  # fmt: skip
        (
            ["demo", "--steps", str(10**12), "--check", "on"],
            rf"^kvplan demo: --steps {10**12}: the reference "
            r"check's requests grow one token a step; .*; lower --steps or pass --check off$",
        ),  # fmt: skip
        (["demo", "--device", "meta"], "--device must be cpu or cuda"),
        (["demo", "--plot", "/nonexistent-kvplan-dir/x.png"], "--plot /nonexistent-kvplan-dir/x.png: folder"),
        (["demo", "--plot", "{tmp}"], "is a folder"),
        (["demo", "--plot", "{tmp}/x.nosuchformat"], "matplotlib cannot write .nosuchformat files"),
        (["demo", "--plot", "{file}/x.png"], "does not exist"),
        (["demo", "--plot", "/proc/x.png"], r"^kvplan demo: --plot /proc/x.png: not writable \("),  # also as root
        (["demo", "--plot", "/sys/x.png"], r"^kvplan demo: --plot /sys/x.png: not writable \("),
        (["demo", "--plot", "/proc/x"], r"^kvplan demo: --plot /proc/x: not writable \("),
        (["demo", "--plot", ""], r"^kvplan demo: --plot: expected a file name, got ''$"),
        (["demo", "--device", ""], r"^kvplan demo: --device: expected cpu, cuda or cuda:N, got ''$"),
        (["demo", "--device", "cpu:1"], r"^kvplan demo: --device cpu:1: the CPU is device cpu or cpu:0, got index 1$"),
        (["demo", "--device", "cuda:99"], r"^kvplan demo: --device cuda:99(: only \d+ CUDA device| needs a CUDA GPU)"),
        (["demo", "--device", "xpu:0"], r"^kvplan demo: --device must be cpu or cuda\[:N\], got xpu:0$"),
        (["demo", "--device", "CPU"], r"^kvplan demo: --device 'CPU' is not a torch device \(Expected one of"),
        (["bench", "pool", "--out-dir", "{file}/sub"], "--out-dir .*: cannot create the folder"),
        (["bench", "pool", "--out-dir", "/proc"], r"^kvplan bench: --out-dir /proc: folder is not writable \("),
        (["bench", "pool", "--out-dir", ""], r"^kvplan bench: --out-dir: expected a folder, got ''$"),
        (["bench", "nope"], "unknown benchmark 'nope'"),
    ],
)
def test_hostile_arguments_give_one_line_and_exit_status_2(argv, message, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, file=_file(tmp_path)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvplan {argv[0]}: "), captured.err
    assert re.search(message, lines[0]), lines[0]
    assert "decode steps on" not in captured.out  # refused before the work started


def test_the_plot_check_creates_nothing_and_keeps_an_existing_file(tmp_path, capsys):
    """The check opens the file for writing before the run; refused later (here by the shapes), a new file is gone
    again and an existing one is as it was."""
    new, old = tmp_path / "new.png", tmp_path / "old.png"
    old.write_bytes(b"an older plot")
    for plot in (new, old):
        assert main(["demo", "--max-batch", "99999999999", "--plot", str(plot)]) == 2
        assert "--max-batch 99999999999, --max-len 160, --hot 16: expected tables" in capsys.readouterr().err
    assert not new.exists() and old.read_bytes() == b"an older plot"


def _demo_lines(argv, capsys):
    code = main(["demo", "--steps", "2", "--check", "off", *argv])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.startswith("kvplan demo:")]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_plot_that_cannot_be_written_exits_non_zero_with_one_line(capsys):
    code, out, lines = _demo_lines(["--plot", "/dev/full"], capsys)
    assert code == 2 and "plot written" not in out
    assert lines == ["kvplan demo: --plot /dev/full: writing the plot failed (No space left on device)"]


def test_cpu_0_is_the_cpu(capsys):
    code, out, lines = _demo_lines(["--device", "cpu:0"], capsys)
    assert code == 0 and lines == [] and "decode steps on cpu (" in out


def test_the_plot_goes_to_the_file_named_and_the_message_names_it(tmp_path, capsys):
    """Without a suffix the plot is a PNG at exactly that path (matplotlib alone would write ``dotted.png``)."""
    code, out, lines = _demo_lines(["--plot", f"{tmp_path}/dotted."], capsys)
    assert code == 0 and lines == []
    assert f"plot written to {tmp_path}/dotted.\n" in out
    assert (tmp_path / "dotted.").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dotted."]


def test_an_absurd_growth_factor_plans_exact_astronomic_sizes(capsys):
    assert main(["plan", "--growth-factor", "1e300", "--batch", "8", "--top-k", "64"]) == 0
    out = capsys.readouterr().out
    assert "E+" in out and "note: under geometric x1e+300, bucketed a buffer would pass" in out
    assert main(["plan", "--growth-factor", "1e300", "--batch", "8", "--top-k", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["geometric x1e+300"]["total"] > 10**300 and result["reserve"]["total"] < 10**7


def test_interrupt_is_exit_status_130_without_a_traceback(monkeypatch, capsys):
    import kvplan.cli.memory

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvplan.cli.memory, "memory_rows", interrupted)
    assert main(["plan"]) == 130
    assert capsys.readouterr().err.strip() == "kvplan plan: interrupted"


def test_a_bug_still_shows_its_traceback(monkeypatch):
    """The boundary turns refusals into exit status 2, not every exception: a kvplan bug must stay visible."""
    import kvplan.cli.memory

    def broken(args):
        raise AssertionError("a kvplan bug")

    monkeypatch.setattr(kvplan.cli.memory, "memory_rows", broken)
    with pytest.raises(AssertionError, match="a kvplan bug"):
        main(["plan"])


def test_the_installed_command_prints_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "kvplan", "demo", "--max-batch", "99999999999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert result.stderr.startswith("kvplan demo: --max-batch 99999999999, --max-len 160, --hot 16: expected tables")


def test_decode_loop_refuses_a_config_larger_than_the_machine_before_allocating():
    config = LoopConfig(max_batch=4, num_reqs=10**12, max_len=1 << 20)
    with pytest.raises(ValueError, match=r"LoopConfig needs .* GiB of host memory .* more than the"):
        DecodeLoop(config, "cpu")


@pytest.mark.parametrize(
    ("seed", "error"), [(-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError)]
)
def test_loop_config_seed_must_fit_a_torch_generator(seed, error):
    with pytest.raises(error, match="LoopConfig.seed must be an int in"):
        LoopConfig(seed=seed)
    LoopConfig(seed=2**64 - 1)


@pytest.mark.parametrize(
    ("scratch", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError)]
)
def test_loop_config_scratch_is_none_or_rows(scratch, error):
    expected = r"^LoopConfig.scratch must be None \(sized by kvplan.sizing.scratch_rows\) or an int >= 0, got "
    with pytest.raises(error, match=expected):
        LoopConfig(scratch=scratch)
    assert LoopConfig(scratch=0).scratch_rows == 0 and LoopConfig(scratch=None).scratch_rows == 16


@pytest.mark.parametrize("growth", ["", "Bucketed", None, 1])
def test_loop_config_growth_names_the_policies(growth):
    with pytest.raises(ValueError, match=r"^LoopConfig.growth must be one of 'exact', 'geometric', 'bucketed', got "):
        LoopConfig(growth=growth)
