"""The docs say what the code and the logs say today: GPU results live on one page generated from the logs
(results/SUMMARY.md, by scripts/results_page.py), not in prose that ages; figures that stay in prose name the
commit they came from."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_page_is_what_the_logs_say(capsys):
    assert _results_page().main(["--check"]) == 0, capsys.readouterr().err


def test_a_log_cut_off_by_its_timeout_is_no_result():
    page = _results_page()
    lines, verdict = page.outcome("memcheck: ERROR SUMMARY: 0 errors | pytest: 4 passed in 9.1s | exit 0\n....rc=124\n")
    assert verdict == "timed out (exit status 124): no result" and len(lines) == 2
    assert page.outcome("== 3 failed, 50 passed in 240.1s ==\n")[1] == "failed"
    assert page.outcome("57 passed, 1 skipped in 240.19s (0:04:00)\ngpu suite rc=0\n")[1] == "clean"
    assert page.outcome("a probe's table\n")[1] == "no outcome line"
    assert "timed out" in (ROOT / "results" / "SUMMARY.md").read_text()  # (final_1ea7bd1_h200.log)


def test_robustness_quotes_no_gpu_result_and_points_to_the_results_page():
    text = (ROOT / "docs" / "robustness.md").read_text()
    assert not re.search(r"\b\d+ passed\b", text), "quote no test counts: they age; link results/SUMMARY.md"
    assert "all clean" not in text and "results/SUMMARY.md" in text


def test_the_readmes_figures_name_their_commit():
    """Set-up first, then what it does, then the performance summary; every performance figure and test count is
    marked with the commit it came from (and a test figure with its date and machine)."""
    text = (ROOT / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections[:3] == ["Set-up", "What it does", "Performance, wins and losses"], sections
    perf = text.split("## Performance, wins and losses")[1].split("\n## ")[0]
    assert (
        "5b8c361" in perf
        and "H200" in perf
        and "current" not in perf.split("- **Wins.**")[0].replace("not the current one", "")
    )
    for paragraph in text.split("\n\n"):
        if re.search(r"\b\d+ passed\b", paragraph):
            assert re.search(r"\b[0-9a-f]{7}\b", paragraph), paragraph  # the commit measured
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", paragraph), paragraph  # and the date
            assert "load" in paragraph and "cores" in paragraph, paragraph  # and the machine
    assert "h200_check.sh" not in text or "has not run on a GPU yet" in text
