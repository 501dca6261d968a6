"""tools/intake_split.py: a padded draft call against a split one, one line each."""

from __future__ import annotations

import re

from repo_tool import load_tool

intake = load_tool("intake_split")


def test_it_times_both_ways_and_names_the_conditions(capsys):
    intake.main(["--context", "40", "--calls", "6"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["one call (padded)", "split"]
    for line in lines:
        assert re.search(r"median \d+\.\d\d ms \(16 rows, one taking in 40 context taps, float32, \d+ threads\)", line)
