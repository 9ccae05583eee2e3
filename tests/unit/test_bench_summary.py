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
    assert text.startswith("at 0.85: 1.26 x (summed 1.23 x) over 3 seeds, 95% interval ")
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


def test_interval_is_students_t_on_the_log_ratios():
    from scipy import stats

    from bench.async_vs_sync import interval

    assert interval([1.4]) is None
    ratios = [1.25, 1.12, 1.42, 1.8, 1.4]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    half = stats.t.ppf(0.975, 4) * sd / math.sqrt(5)
    lo, hi = interval(ratios)
    assert math.isclose(lo, math.exp(mean - half)) and math.isclose(hi, math.exp(mean + half))
    assert lo < math.exp(mean) < hi
    assert interval([1.5, 1.5]) == (1.5, 1.5)
    s = summarise({0: {"sync": 3.0, "async": 2.0}, 1: {"sync": 4.0, "async": 2.0}})
    assert s["interval"] == interval([1.5, 2.0])
    assert describe(0.85, s).startswith("at 0.85: 1.73 x (summed 1.75 x) over 2 seeds, 95% interval ")


def _invocation(tmp_path, stamp, seeds, **settings):
    from bench.async_vs_sync import SETTINGS, save

    base = dict.fromkeys(SETTINGS, 1) | settings
    times = {0.85: {s: {"sync": 3.0 + s, "async": 2.0} for s in seeds}, 0.9: {s: {"sync": None, "async": 5.0} for s in seeds}}
    return save(tmp_path, base, times, {s: 1.3 for s in seeds}, stamp, {s: {"sync": 2.0 + s, "async": 2.6 + s} for s in seeds})


def test_invocations_combine_into_one_set_of_seeds(tmp_path):
    from bench.async_vs_sync import combine

    a = _invocation(tmp_path, "a", [0, 1])
    b = _invocation(tmp_path, "b", [2])
    settings, times, steps, paces = combine([a, b])
    assert settings["max_lag"] == 1
    assert times[0.85] == {0: {"sync": 3.0, "async": 2.0}, 1: {"sync": 4.0, "async": 2.0}, 2: {"sync": 5.0, "async": 2.0}}
    assert times[0.9][2] == {"sync": None, "async": 5.0}
    assert steps == {0: 1.3, 1: 1.3, 2: 1.3}
    assert paces == {0: {"sync": 2.0, "async": 2.6}, 1: {"sync": 3.0, "async": 3.6}, 2: {"sync": 4.0, "async": 4.6}}


def test_files_without_paces_still_combine(tmp_path):
    import json

    from bench.async_vs_sync import combine

    a = _invocation(tmp_path, "a", [0])
    data = json.loads(a.read_text())
    del data["steps_per_s"]  # written before the pace was recorded
    a.write_text(json.dumps(data))
    _, _, steps, paces = combine([a, _invocation(tmp_path, "b", [1])])
    assert steps == {0: 1.3, 1: 1.3} and paces == {1: {"sync": 3.0, "async": 3.6}}


def test_combine_refuses_other_settings_and_a_seed_twice(tmp_path):
    import pytest

    from bench.async_vs_sync import combine

    a = _invocation(tmp_path, "a", [0])
    with pytest.raises(SystemExit, match="max_lag is 2"):
        combine([a, _invocation(tmp_path, "b", [1], max_lag=2)])
    with pytest.raises(SystemExit, match="seed 0 is in both"):
        combine([a, _invocation(tmp_path, "c", [0])])


def test_report_prints_the_figures_and_exits_1_without_one(capsys):
    import pytest

    from bench.async_vs_sync import report

    report({0.85: {0: {"sync": 3.0, "async": 2.0}}}, {0: 1.2}, 0.85, 30, {0: {"sync": 2.5, "async": 3.0}})
    out = capsys.readouterr().out
    assert "FIGURE async_speedup 1.50 x" in out and "FIGURE async_steps_per_s_ratio 1.20 x" in out
    assert "lock-step pace (the machine's): 2.50-2.50 steps/s over 1 seed" in out
    with pytest.raises(SystemExit) as e:
        report({0.85: {0: {"sync": None, "async": 2.0}}}, {0: 1.2}, 0.85, 30)
    assert e.value.code == 1
