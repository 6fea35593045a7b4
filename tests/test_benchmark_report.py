"""The benchmarks' shared reporting: a peak's growth over rounds."""

from benchmarks import report


def test_peak_windows_split_the_rounds_after_the_start():
  assert report.peak_windows(5, 20) == (range(6, 13), range(14, 21))
  assert report.peak_windows(5, 10) == (range(6, 8), range(9, 11))
  assert report.peak_windows(5, 5) == (range(6, 6), range(6, 6))


def test_peak_growth_ignores_where_a_periodic_copy_falls_and_sees_a_leak():
  # Copied every second round: single samples after rounds 5 and 20 would read +25%.
  periodic = {r: 8 if r % 2 else 10 for r in range(1, 21)}
  assert periodic[5] == 8 and periodic[20] == 10
  assert report.peak_growth(periodic, 5, 20) == "+0%"
  # Growing 0.1 a round: peaks 9.2 (rounds 6-12) and 10.0 (rounds 14-20).
  leaking = {r: 8 + r / 10 for r in range(1, 21)}
  assert report.peak_growth(leaking, 5, 20) == "+9%"
  assert report.peak_growth(periodic, 5, 5) == "-"
