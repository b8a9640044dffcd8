"""The report's score histograms and the images it shows nearest a gate's threshold (jobs.report_scores)."""

from __future__ import annotations

import re

import pytest

from ditfleet.jobs.report_scores import ScoreSection, histogram, histogram_svg, nearest_threshold


def test_every_value_lands_in_one_bin_between_round_ends():
    values = [0.8, 0.8, 0.85, 0.99, 1.0, 1.0, 1.0]
    hist = histogram(values, bins=4)
    assert (hist.lo, hist.hi) == pytest.approx((0.8, 1.0))
    # [0.8, 0.85) [0.85, 0.9) [0.9, 0.95) [0.95, 1.0]: the top edge belongs to the last bin.
    assert hist.counts == [2, 1, 0, 4]
    assert sum(histogram([3.0, 1234.5, 77.0]).counts) == 3


def test_the_range_stretches_to_show_a_threshold_no_score_reaches():
    hist = histogram([0.1, 0.2, 0.3], bins=10, include=0.9)
    assert hist.lo <= 0.1 and hist.hi >= 0.9 and sum(hist.counts) == 3
    one_value = histogram([5.0, 5.0])
    assert one_value.lo < 5.0 < one_value.hi and sum(one_value.counts) == 2


def test_a_histogram_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one value"):
        histogram([])


def test_nearest_the_threshold_takes_each_side_nearest_first_shown_rising():
    scored = [(0.2, "a"), (0.79, "b"), (0.8, "c"), (1.0, "d"), (0.6, "e"), (0.8, "f"), (0.95, "g")]
    below, above = nearest_threshold(scored, 0.8, each=2)
    assert below == [(0.6, "e"), (0.79, "b")]  # the two highest under 0.8, rising
    assert above == [(0.8, "c"), (0.8, "f")]  # the gate passes a score equal to its min; ties keep order
    assert nearest_threshold(scored, 2.0, each=3) == ([(0.8, "c"), (0.95, "g"), (1.0, "d")], [])


def test_the_svg_draws_a_bar_per_filled_bin_and_the_threshold_inside_the_plot():
    section = ScoreSection("tiny", [0.8, 0.8, 1.0, 1.0, 1.0], unscored=1, threshold=1.0)
    svg = histogram_svg(section)
    assert svg.count('class="hist-bar"') == 2
    x = float(re.search(r'class="threshold" x1="([\d.]+)"', svg).group(1))
    assert 48 < x <= 640 - 10  # within the x axis, at its right end here
    assert "gate min 1" in svg and 'id="hist-tiny"' in svg
    assert 'class="threshold"' not in histogram_svg(ScoreSection("sharpness", [1.0, 2.0], unscored=0))
