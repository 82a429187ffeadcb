"""Readable axes (issue 60, item 3): a chart's tick labels are distinct, with more digits or the
date as the ticks' spacing needs, for any series, a single point included; and each names its
tick. extension/src/ticks.ts labels ticks placed as uPlot places them (tests/extension_node.js
ports where uPlot puts them), in Node, in UTC."""
from __future__ import annotations

import datetime as dt
import re

import pytest

import ext_node

pytestmark = pytest.mark.slow  # starts Node

T0 = 1765124323.0  # 2025-12-07 16:18:43 UTC


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return ext_node.build(tmp_path_factory.mktemp("ext"))


def _labels(built, cases):
    return ext_node.run(built, "ticks", cases)


def test_a_nearly_flat_series_and_a_second_of_samples(built):
    """What the issue saw: host RAM at 1.33882..1.33911 GiB ("1.339" three times) and a run's
    first second of telemetry ("16:18:43" five times)."""
    ram, clock, flat = _labels(built, [
        {"min": 1.33882, "max": 1.33911, "dim": 150},
        {"min": T0, "max": T0 + 1, "dim": 470, "time": True},
        {"min": 1.339, "max": 1.339, "dim": 150}])
    assert ram["labels"] == ["1.3388", "1.3389", "1.3390", "1.3391"], ram
    assert clock["labels"] == ["16:18:43.0", "16:18:43.2", "16:18:43.4", "16:18:43.6",
                               "16:18:43.8", "16:18:44.0"], clock
    assert flat["labels"] == ["0", "1", "2"], flat  # uPlot pads a flat one: short labels


def test_a_single_point(built):
    number, clock = _labels(built, [{"splits": [1.339]}, {"splits": [T0], "time": True}])
    assert number["labels"] == ["1.339"] and clock["labels"] == ["16:18:43"]


def test_ticks_days_apart_carry_the_date(built):
    (days,) = _labels(built, [{"min": T0, "max": T0 + 3 * 86400, "dim": 470, "time": True}])
    assert days["labels"][:3] == ["12-08 00:00:00", "12-08 08:00:00", "12-08 16:00:00"], days


def test_every_range_gets_distinct_labels_that_name_their_ticks(built):
    cases = []
    for base in (0.0, 1.339, -0.5, 123.25, 12345.0, -2e5, 1e6, 1e9, 3e-4, 1.3e-7, -4.2e-9):
        for rel in (0.0, 1e-9, 1e-6, 1e-4, 1e-2, 0.5, 1.0, 100.0):
            span = rel * (abs(base) or 1.0)
            for dim in (60, 150, 470):
                cases.append({"min": base, "max": base + span, "dim": dim})
    for span in (0.0004, 0.3, 1.0, 5.0, 61.0, 3600.0, 2 * 86400.0):
        for dim in (150, 470, 1200):
            cases.append({"min": T0, "max": T0 + span, "dim": dim, "time": True})
    bad = []
    for case, got in zip(cases, _labels(built, cases)):
        labels, splits, incr = got["labels"], got["splits"], got["incr"]
        named = [_clock_value(lb) if case.get("time") else _number(lb) for lb in labels]
        ok = (len(set(labels)) == len(labels) and all(labels)
              and all(abs(v - s) <= max(incr * 1e-3, abs(s) * 1e-12)
                      for v, s in zip(named, splits)))
        if not ok:
            bad.append((case, incr, splits, labels))
    assert not bad, f"{len(bad)} of {len(cases)}: {bad[:5]}"


def _number(label: str) -> float:
    scale = {"k": 1e3, "M": 1e6}.get(label[-1:], 1.0)
    return float(label.rstrip("kM")) * scale


def _clock_value(label: str) -> float:
    """Unix seconds of an HH:MM:SS(.fff) or MM-DD HH:MM:SS(.fff) label, in T0's year (UTC)."""
    m = re.fullmatch(r"(?:(\d\d)-(\d\d) )?(\d\d):(\d\d):(\d\d)(\.\d+)?", label)
    assert m, label
    day = dt.datetime.fromtimestamp(T0, dt.timezone.utc)
    month, mday = (int(m[1]), int(m[2])) if m[1] else (day.month, day.day)
    at = dt.datetime(day.year, month, mday, int(m[3]), int(m[4]), int(m[5]),
                     tzinfo=dt.timezone.utc)
    return at.timestamp() + float(m[6] or 0)
