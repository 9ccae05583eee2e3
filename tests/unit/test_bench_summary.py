"""bench/async_vs_sync.py's summary: the figure over the seeds both runs reached, and
the seeds only one run (or neither) reached listed instead of ending the bench."""

import math

from bench.async_vs_sync import describe, summarise


def test_geometric_mean_over_seeds_both_reached_and_the_rest_listed():
    times = {
        0: {"sync": 6.0, "async": 3.0},  # 2.0
        1: {"sync": 4.0, "async": 8.0},  # 0.5
        2: {"sync": 9.0, "async": 4.5},  # 2.0
        3: {"sync": None, "async": 22.0},
        4: {"sync": 12.0, "async": None},
        5: {"sync": None, "async": None},
    }
    s = summarise(times)
    assert s["ratios"] == {0: 2.0, 1: 0.5, 2: 2.0}
    assert math.isclose(s["geo"], 2.0 ** (1 / 3))
    assert math.isclose(s["summed"], 19.0 / 15.5)
    assert (s["async_only"], s["sync_only"], s["neither"]) == ([3], [4], [5])
    text = describe(0.85, s)
    assert text.startswith("at 0.85: 1.26 x (summed 1.23 x) over 3 seeds")
    assert "only the asynchronous run reached it: seeds [3]" in text
    assert "only lock step reached it: seeds [4]" in text and "neither reached it: seeds [5]" in text


def test_no_seed_reached_by_both_gives_no_figure():
    s = summarise({0: {"sync": None, "async": 3.0}})
    assert s["geo"] is None and s["summed"] is None and s["ratios"] == {}
    assert describe(0.9, s).startswith("at 0.9: no ratio over 0 seeds")


def test_a_warmed_up_model_that_already_passes_is_a_ratio_of_one():
    s = summarise({0: {"sync": 0.0, "async": 0.0}, 1: {"sync": 3.0, "async": 1.5}})
    assert s["ratios"] == {0: 1.0, 1: 2.0}
    only = summarise({0: {"sync": 0.0, "async": 0.0}})
    assert only["geo"] == 1.0 and only["summed"] == 1.0
    assert describe(0.7, only) == "at 0.7: 1.00 x (summed 1.00 x) over 1 seed"
