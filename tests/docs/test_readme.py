"""The README's usage example runs as written and does what it says."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_usage_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    example = blocks[0]
    assert len([line for line in example.splitlines() if line.strip()]) <= 15
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"rows copied per request: \[(\d+), (\d+)\] stats: (\d+)", proc.stdout)
    assert match, proc.stdout
    a, b, total = map(int, match.groups())
    assert a > 0 and b > 0 and a + b == total


def test_version_is_one_in_pyproject_the_package_and_the_changelog():
    import kvplan

    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert kvplan.__version__ == version
    releases = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert releases and releases[0] == version, releases
