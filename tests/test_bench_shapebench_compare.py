"""bench/shapebench_compare.py's statistics on inputs with known answers: the t-interval over seeds,
a curve read between its measurements, and the table's equal-samples and equal-time columns; its
held-out set and its figure."""

import json
import math

import pytest
import shapebench_compare as bench
from seed_statistics import t_interval, value_at


def test_t_interval_of_one_two_three_by_hand():
    # mean 2, sample std 1, standard error 1 / sqrt(3); Student's t at 0.975 with 2 degrees of freedom
    # is 4.302652729749464 (tables: 4.303), so the half-width is 4.3027 / 1.7321 = 2.4841
    iv = t_interval([1.0, 2.0, 3.0])
    assert (iv.mean, iv.n) == (2.0, 3)
    assert iv.low == pytest.approx(2 - 4.302652729749464 / math.sqrt(3), rel=1e-12)
    assert iv.high == pytest.approx(2 + 2.4841377118, rel=1e-9)
    # 90 %: t = 2.919985580355516 at 0.95 with 2 degrees of freedom
    assert t_interval([1.0, 2.0, 3.0], 0.90).high == pytest.approx(2 + 2.919985580355516 / math.sqrt(3))
    one = t_interval([0.4])
    assert one.mean == 0.4 and math.isnan(one.low) and math.isnan(one.high) and str(one) == "0.400 (1 seed)"
    assert t_interval([0.3, 0.3, 0.3])[1:3] == (0.3, 0.3)
    with pytest.raises(ValueError):
        t_interval([])


def test_value_at_reads_a_linear_curve_exactly():
    xs, ys = [0.0, 10.0, 30.0], [1.0, 21.0, 61.0]  # y = 2 x + 1
    assert [value_at(xs, ys, x) for x in (0.0, 5.0, 10.0, 15.0, 30.0)] == pytest.approx([1, 11, 21, 31, 61])
    with pytest.raises(ValueError, match="outside the measured range"):
        value_at(xs, ys, 31.0)
    with pytest.raises(ValueError, match="must increase"):
        value_at([0.0, 10.0, 10.0], [1.0, 2.0, 3.0], 5.0)


def run(algorithm, seed, seconds_per_epoch, strict, partial):
    """A synthetic run: evaluations after 0, 2 and 4 epochs of 128 samples."""
    curve = [{"epoch": e, "samples": 128 * e, "train_s": seconds_per_epoch * e, "strict": s, "partial": p}
             for e, s, p in zip((0, 2, 4), strict, partial)]
    return {"algorithm": algorithm, "seed": seed, "epochs": 4, "epoch_s": seconds_per_epoch, "curve": curve}


RUNS = [  # "fast" takes 10 s an epoch, "slow" 20 s; strict rises linearly in time for both
    run("fast", 0, 10.0, [0.2, 0.3, 0.4], [0.6, 0.6, 0.7]),
    run("fast", 1, 10.0, [0.2, 0.4, 0.6], [0.6, 0.7, 0.8]),
    run("fast", 2, 10.0, [0.2, 0.35, 0.5], [0.6, 0.65, 0.75]),
    run("slow", 0, 20.0, [0.2, 0.4, 0.5], [0.6, 0.7, 0.9]),
    run("slow", 1, 20.0, [0.2, 0.5, 0.7], [0.6, 0.8, 0.8]),
]


def test_the_table_reads_every_run_at_equal_samples_and_at_the_shortest_runs_time():
    budget, rows = bench.summarize(RUNS)
    assert budget == 40.0  # the fast runs' 4 epochs
    fast, slow = rows["fast"], rows["slow"]
    assert fast["seeds"] == [0, 1, 2] and fast["samples"] == 512
    assert fast["strict_samples"] == t_interval([0.4, 0.6, 0.5])
    assert slow["partial_samples"] == t_interval([0.9, 0.8])
    # at 40 s a fast run is at its end; a slow one is at its second evaluation (2 epochs of 20 s)
    assert fast["strict_time"] == t_interval([0.4, 0.6, 0.5])
    assert slow["strict_time"] == t_interval([0.4, 0.5])
    assert slow["partial_time"] == t_interval([0.7, 0.8])
    assert slow["epoch_s"].mean == 20.0 and fast["before"].mean == pytest.approx(0.2)
    # with a 30 s budget a slow run is read halfway between its first two evaluations
    short = [r for r in RUNS if r["algorithm"] == "slow"] + [run("fast", 0, 7.5, [0.2, 0.3, 0.4], [0.6, 0.6, 0.7])]
    budget, rows = bench.summarize(short)
    assert budget == 30.0
    assert rows["slow"]["strict_time"].mean == pytest.approx(((0.2 + 0.75 * 0.2) + (0.2 + 0.75 * 0.3)) / 2)


def test_the_held_out_set_repeats_test_txt(tmp_path):
    folder = bench.write_dataset(tmp_path / "data", 512)
    held_out = (bench.PROMPTS / "test.txt").read_text().splitlines()
    assert len(held_out) == 256
    assert (folder / "test.txt").read_text().splitlines() == held_out * 2
    assert (folder / "train.txt").read_text() == (bench.PROMPTS / "train.txt").read_text()


def test_the_figure_has_a_band_per_algorithm_with_seeds(tmp_path):
    from PIL import Image

    bench.plot(RUNS, tmp_path / "compare.png")
    image = Image.open(tmp_path / "compare.png")
    assert image.size == (1200, 480)
    with pytest.raises(ValueError, match="different sample counts"):
        bench.plot(RUNS + [run("slow", 2, 20.0, [0.2, 0.4, 0.5], [0.6, 0.7, 0.9]) | {"curve": RUNS[0]["curve"][:2]}],
                   tmp_path / "bad.png")


def test_equal_time_reads_cpu_seconds_when_every_run_used_one_thread():
    # the same runs, with CPU clocks that disagree with their wall clocks: "slow" ran beside other
    # work (wall 20 s an epoch) but needed only 10 CPU seconds, as "fast" did
    on_cpu = [r | {"threads": 1, "epoch_cpu_s": 10.0,
                   "curve": [p | {"train_cpu_s": 10.0 * p["epoch"]} for p in r["curve"]]} for r in RUNS]
    assert bench.clock_of(on_cpu) == "cpu"
    assert bench.clock_of(RUNS) == "wall"  # older runs without a CPU clock
    assert bench.clock_of([on_cpu[0], on_cpu[1] | {"threads": 2}]) == "wall"  # CPU time sums threads
    budget, rows = bench.summarize(on_cpu, "cpu")
    assert budget == 40.0
    assert rows["slow"]["strict_time"] == t_interval([0.5, 0.7])  # at its end, not halfway
    assert rows["slow"]["epoch_s"].mean == 10.0


def test_resume_refuses_results_made_in_another_world(tmp_path):
    world = {"samples": 8192, "eval_samples": 512, "evals": 4, "threads": 1}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({**world, "runs": RUNS[:1]}))
    assert bench.resumed(path, world)["runs"] == RUNS[:1]
    with pytest.raises(SystemExit, match=r"eval_samples=512 \(now 256\)"):
        bench.resumed(path, world | {"eval_samples": 256})
