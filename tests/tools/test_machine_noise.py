"""tools/machine_noise.py: one speed reading per window, and the report of their spread."""

from __future__ import annotations

import pytest
from repo_tool import load_tool

noise = load_tool("machine_noise")


def test_one_positive_reading_per_window():
    rates = noise.measure(0.3, 0.05, size=32, calls=5)
    assert 4 <= len(rates) <= 7  # the last window may start just before the end
    assert all(rate > 0 for rate in rates)


def test_report_names_the_spread_of_identical_work(capsys):
    assert noise.main(["--seconds", "0.4", "--window", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "windows of 0.05 s, speed relative to their median: min " in out
    assert "one window over the next (identical work): p10 " in out


def test_too_few_windows_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        noise.main(["--seconds", "0.1", "--window", "0.1"])
    assert "expected at least 3" in capsys.readouterr().err
