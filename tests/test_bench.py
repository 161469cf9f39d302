"""make bench's parts: the memory model against hand-computed bytes, the results writer, and a smoke run.

- memory_model: 1e6 parameters on 4 ranks, every strategy in fp32 and bf16, against bytes worked out by hand from the
  rules in its docstring (ds_configs/*.json as shipped: reduce buckets of 2e7 elements, overlap_comm,
  contiguous_gradients).
- The results writer turns a results dict into .md/.json/.png and rewrites README's bench block.
- Smoke test (multiproc): the bench's own path on the tiny model, 4 steps, two strategies; rows must have positive
  throughput and model-state bytes within 10% of the prediction. No timing assertions.
"""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from scripts.measure import bench, bench_host, bench_load, bench_report
from scripts import memory_model as mm

P, N = 1_000_000, 4
BUCKET2 = 20_000_000  # reduce_bucket_size of the shipped ZeRO-2 JSONs, in elements
BUCKET = 20_000_000  # and of the ZeRO-3 JSONs (DeepSpeed allocates it whole, whatever the model's size)
# (resident, peak) bytes per rank for P parameters on N ranks, Adam; "peak" adds what exists only around the step.
EXPECTED = {
    # fp32 params 4P + Adam 8P; fp32 grads 4P until zero_grad. Autocast bf16 keeps the same tensors.
    ("single", "fp32"): (12 * P, 16 * P),
    ("single", "bf16"): (12 * P, 16 * P),
    # + DDP's gradient buckets, 4P, resident (in C++).
    ("ddp", "fp32"): (16 * P, 20 * P),
    ("ddp", "bf16"): (16 * P, 20 * P),
    # params whole in the compute dtype + (4 master + 8 Adam) P/N; step: grad partition (+ its fp32 copy in bf16)
    # and 2 reduce buckets (overlap_comm).
    ("zero2", "fp32"): (4 * P + 12 * P // N, 4 * P + 16 * P // N + 2 * BUCKET2 * 4),
    ("zero2", "bf16"): (2 * P + 12 * P // N, 2 * P + 18 * P // N + 2 * BUCKET2 * 2),
    # offload: master, moments, fp32 grad partition and a compute-dtype staging partition stay on the host.
    ("zero2_offload", "fp32"): (4 * P + 20 * P // N, 4 * P + 20 * P // N + 2 * BUCKET2 * 4),
    ("zero2_offload", "bf16"): (2 * P + 18 * P // N, 2 * P + 18 * P // N + 2 * BUCKET2 * 2),
    # partitions b P/N + 12 P/N + grad buffer b P/N + 1 reduce bucket; step: all gathered (b P) + fp32 grad 4P/N.
    ("zero3", "fp32"): (20 * P // N + BUCKET * 4, 4 * P + 24 * P // N + BUCKET * 4),
    ("zero3", "bf16"): (16 * P // N + BUCKET * 2, 2 * P + 20 * P // N + BUCKET * 2),
    # offload keeps the fp32 grad partition on the host for good.
    ("zero3_offload", "fp32"): (24 * P // N + BUCKET * 4, 4 * P + 24 * P // N + BUCKET * 4),
    ("zero3_offload", "bf16"): (20 * P // N + BUCKET * 2, 2 * P + 20 * P // N + BUCKET * 2),
    # fp32 shards 4P/N + Adam 8P/N; fp32 grad shards 4P/N until zero_grad, whatever the compute dtype.
    ("fsdp", "fp32"): (12 * P // N, 16 * P // N),
    ("fsdp", "bf16"): (12 * P // N, 16 * P // N),
}


@pytest.mark.parametrize("strategy,precision", sorted(EXPECTED))
def test_memory_model_matches_hand_computed_bytes(strategy, precision):
    world = 1 if strategy == "single" else N
    totals = mm.totals(mm.predict(strategy, mm.ModelShape(num_params=P), world, precision))
    assert (totals["resident"], totals["peak"]) == EXPECTED[(strategy, precision)]


def test_memory_model_places_offloaded_state_on_the_host():
    shape = mm.ModelShape(num_params=P)
    zero3 = mm.totals(mm.predict("zero3_offload", shape, N, "bf16"))
    assert zero3["device_resident"] == BUCKET * 2  # the reduce bucket; all partitions went to the host
    assert zero3["host_resident"] == 20 * P // N
    zero2 = mm.totals(mm.predict("zero2_offload", shape, N, "bf16"))
    assert (zero2["device_resident"], zero2["host_resident"]) == (2 * P, 18 * P // N)


def test_memory_model_keeps_small_zero3_parameters_whole():
    """Parameters of at most stage3_param_persistence_threshold elements (10,000 in the shipped JSON) stay whole on
    every rank."""
    shape = mm.ModelShape(num_params=1_000_000, param_numels=[690_000, 300_000, 10_000], hidden_size=1024)
    parts = mm.predict("zero3", shape, N, "bf16")
    resident_params = sum(p.nbytes for p in parts if p.name == "parameters" and p.resident)
    assert resident_params == 2 * 10_000 + 2 * (1_000_000 // N)  # whole small one + the partition of all
    assert mm.totals(parts)["after_eval"] - mm.totals(parts)["resident"] == 2 * 990_000  # gathered by evaluation


def test_memory_model_fills_auto_sizes_as_accelerate_does():
    """"auto" bucket and persistence sizes come from the hidden size: hidden^2 and 10 x hidden elements."""
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "contiguous_gradients": True,
                                "stage3_param_persistence_threshold": "auto"}}
    shape = mm.ModelShape(num_params=P, param_numels=[900_000, 1_280, 98_720], hidden_size=128)
    parts = {p.what: p.nbytes for p in mm.predict("zero3", shape, N, "bf16", ds_config=ds)}
    assert parts["reduce bucket"] == 2 * 128 * 128
    assert parts["persistent bf16 parameters, whole"] == 2 * 1_280


def test_memory_model_counts_ddp_buckets_apart_from_what_memstats_sees():
    totals = mm.totals(mm.predict("ddp", mm.ModelShape(num_params=P), N, "fp32"))
    assert totals["after_eval"] == 12 * P and totals["buffers_after_eval"] == 0
    # the bench's collective counter wraps the bucket in a Python tensor (measured: other bytes 23,220 -> 6,037,180 on
    # the tiny model's 6,013,960 bytes of gradients with CLS_COMM=1)
    counted = mm.totals(mm.predict("ddp", mm.ModelShape(num_params=P), N, "fp32", comm_counted=True))
    assert counted["after_eval"] == 16 * P and counted["buffers_after_eval"] == 4 * P


def test_memory_model_cli_prints_a_row_per_strategy(capsys):
    mm.main(["--num_params", "355e6", "--num_processes", "8", "--precision", "bf16"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in mm.STRATEGIES}
    assert set(rows) == set(mm.STRATEGIES)
    assert rows["ddp"][4] == f"{16 * 355e6 / 1024**3:.2f}"  # resident: 4 + 8 + 4 (buckets) bytes per parameter
    assert rows["fsdp"][4] == f"{12 * 355e6 / 8 / 1024**3:.2f}"


def test_memory_model_reads_the_tiny_model_shape(tiny_model):
    shape = mm.shape_from_model(str(tiny_model))
    assert shape.num_params == 1_503_490 and sum(shape.param_numels) == shape.num_params
    assert 0 < shape.fsdp_root_params < shape.num_params


def test_throughput_leaves_out_the_warmup():
    metrics = [{"elapsed": e, "samples": 32, "tokens": 1000} for e in (5.0, 6.0, 7.0, 9.0)]  # step 1 is slow
    got = bench_report.throughput(metrics, warmup_steps=1)
    assert got == {"samples_per_s": 96 / 4.0, "tokens_per_s": 3000 / 4.0, "step_time_s": 1.0, "fast_step_time_s": 1.0}


def test_failure_reason_is_the_child_error_not_the_launcher_error():
    log = ("training ...\nTraceback (most recent call last):\n  File \"recipes/cls.py\", line 9\n"
           "ValueError: Default process group has not been initialized.\nTraceback (most recent call last):\n"
           "subprocess.CalledProcessError: Command '['python', 'recipes/cls.py']' returned non-zero exit status 1.\n")
    assert bench.failure_reason(log) == "ValueError: Default process group has not been initialized."


def fake_results() -> dict:
    """Round 0 of single, fsdp (failed) and loop, and a round 1 of single and loop: epoch seconds 10 / 9.5 and
    12 / 10 (ratios 1.0526 and 1.2)."""
    ok = dict(bench.Run(model="tiny", name="single", kind="strategy").__dict__, world=1, threads=2,
              samples_per_s=150.0, tokens_per_s=7000.0, step_time_s=0.25, fast_step_time_s=0.2,
              epoch_s=10.0, padding_efficiency=0.375, state_measured=18_100_000, state_predicted=18_042_000,
              memory_ratio=18_100_000 / 18_042_000, peak_rss=1_150_000_000, accuracy=0.61, final_loss=0.65, mfu=0.025,
              breakdown={"parameters": [6e6, 6e6], "optimizer_state": [12e6, 12e6],
                         "gradients_and_other": [1e5, 0]})
    loop = dict(ok, name="loop", kind="baseline", step_time_s=0.24, fast_step_time_s=0.19, samples_per_s=160.0,
                epoch_s=9.5)
    failed = dict(bench.Run(model="tiny", name="fsdp", kind="strategy").__dict__, status="failed",
                  reason="ValueError: no FSDP on CPU")
    again = [dict(ok, round=1, seed=43, epoch_s=12.0, accuracy=0.6), dict(loop, round=1, seed=43, epoch_s=10.0)]
    same = dict(bench.Run(model="tiny", name="alternate", kind="baseline").__dict__, alternate=[
        {"recipe": 9.7, "loop": 10.0, "trainer": 10.0}, {"recipe": 10.1, "loop": 10.0, "trainer": 10.8}])
    runs = [ok, failed, loop, *again, same]
    return {"date": "2026-01-02", "started": "2026-01-02T03:04:05", "duration_s": 600.0, "command": "make bench",
            "hardware": {"host": "box", "cpu": "test cpu", "cpu_cores": 2, "gpus": [], "device": "cpu"},
            "versions": {"torch": "2.13.0"}, "memory_label": "peak RSS",
            "work": {"tiny": {"model": "artifacts/tiny-roberta", "random_init": False, "precision": "fp32",
                              "learning_rate": 1e-3, "steps": 40, "warmup_steps": 5, "effective_batch": 32,
                              "train_samples": 1280, "eval_samples": 256, "max_length": 128, "seed": 42}},
            "runs": runs, "ratios": bench_report.ratios(runs)}


def no_interval(ratio: dict) -> dict:
    """A ratio's median, min-max and rounds, its bootstrap interval set apart: over 2 to 4 rounds the interval is
    always [min, max] (a median of 4 draws falls on the lowest of 4 values with probability 13/256, above 0.025)."""
    ratio = dict(ratio)
    assert ratio.pop("ci95") == [ratio["min"], ratio["max"]]
    return ratio


def test_headline_ratios_carry_the_bootstrap_interval_of_their_median():
    """60 blocks whose ratios are known: the median's 95% interval is the one computed here by the same recipe
    (2,000 resamples) and lies inside min-max, about as wide as the normal approximation of a median's spread; the
    same blocks always give the same interval; a headline ratio states its half-width against the goal, another
    ratio only its interval, and one value has none."""
    values = [1.0 + 0.1 * ((i * 37) % 60 - 29.5) / 29.5 for i in range(60)]  # evenly spread over [0.9, 1.1]
    ci = bench_report.median_interval(values)
    assert ci == bench_report.median_interval(list(values))  # seeded
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=60)) for _ in range(2000))
    assert ci == [medians[50], medians[1949]]
    assert min(values) < ci[0] < statistics.median(values) < ci[1] < max(values)
    # a uniform spread of width 0.2: the median's standard error is about 0.2 / (2 sqrt 60), 1.96 of them 0.025
    assert 0.015 < (ci[1] - ci[0]) / 2 < 0.04
    assert bench_report.median_interval([1.0]) is None
    same = bench_report.spread(values, interval=True)
    assert same["ci95"] == ci and "ci95" not in bench_report.spread(values)
    wide = {**same, "ci95": [0.9, 1.2]}
    text = "\n".join(bench_report.ratio_lines({"ratios": {"tiny": {
        "recipe_vs_hand_loop_same_process": same, "trainer_vs_recipe_time": wide, "pad128_vs_dynamic_time": wide}}}))
    half = (ci[1] - ci[0]) / 2
    assert (f"60 blocks of steps taken in turn in one process; 95% interval of the median {ci[0]:.3f}-{ci[1]:.3f}, "
            f"half-width {half:.3f} (goal <= 0.03: met)) (goal <= 1.03: met)") in text
    assert "60 interleaved rounds; 95% interval of the median 0.900-1.200, half-width 0.150 (goal <= 0.03: NOT " \
        "met))" in text
    assert "pad-to-128 / dynamic padding: **1.000x** (min 0.900, max 1.100; 60 interleaved rounds; 95% interval of " \
        "the median 0.900-1.200)\n" in text + "\n"


def test_ratios_are_medians_of_the_interleaved_rounds():
    got = bench_report.ratios(fake_results()["runs"])["tiny"]
    assert no_interval(got["recipe_vs_hand_loop_time"]) == pytest.approx(
        {"median": (10 / 9.5 + 1.2) / 2, "min": 10 / 9.5, "max": 1.2, "rounds": 2})
    assert got["accuracy"] == {"single": [0.61, 0.6]} and "trainer_vs_recipe_time" not in got
    assert got["memory_measured_vs_predicted"] == {"single": pytest.approx(18_100_000 / 18_042_000), "loop":
                                                   pytest.approx(18_100_000 / 18_042_000)}


def test_grouped_ratios_and_accuracy_are_paired_by_round():
    def run(name, round_, epoch_s, accuracy):
        return dict(bench.Run(model="tiny", name=name, kind="baseline", round=round_).__dict__, epoch_s=epoch_s,
                    accuracy=accuracy, memory_ratio=None)

    runs = [run("single", 0, 9.0, 0.600), run("pad128", 0, 10.0, 0.604), run("grouped", 0, 4.0, 0.598),
            run("single", 1, 8.0, 0.610), run("pad128", 1, 9.0, 0.610), run("grouped", 1, 5.0, 0.620),
            run("single", 2, 7.0, 0.590), run("grouped", 2, 3.5, 0.580)]  # round 2 lost its pad128 run
    got = bench_report.ratios(runs)["tiny"]
    assert no_interval(got["grouped_speedup_vs_pad128"]) == pytest.approx({"median": 2.15, "min": 1.8, "max": 2.5, "rounds": 2})
    assert no_interval(got["grouped_speedup_vs_dynamic"]) == pytest.approx({"median": 2.0, "min": 1.6, "max": 2.25, "rounds": 3})
    diff = got["grouped_minus_dynamic_accuracy_points"]
    assert diff["mean"] == pytest.approx((-0.2 + 1.0 - 1.0) / 3) and diff["min"] == pytest.approx(-1.0)
    text = "\n".join(bench_report.ratio_lines({"ratios": {"tiny": got}}))
    assert "grouped batches' speed-up over pad-to-128: **2.150x** (min 1.800, max 2.500; 2 interleaved rounds; 95% " \
           "interval of the median 1.800-2.500) (goal >= 2.0: met)" in text
    assert "grouped - dynamic accuracy: **-0.07 points** mean" in text and "goal within 0.5: met" in text


def test_kernel_ratios_compare_the_default_recipe_with_its_plain_kernels_by_round():
    def run(name, round_, epoch_s):
        return dict(bench.Run(model="tiny", name=name, kind="baseline", round=round_).__dict__, epoch_s=epoch_s,
                    memory_ratio=None)

    runs = [run("single", 0, 10.0), run("unfused", 0, 11.0), run("eager_attn", 0, 12.0),
            run("single", 1, 8.0), run("unfused", 1, 9.6), run("eager_attn", 1, 8.8)]
    got = bench_report.ratios(runs)["tiny"]
    assert no_interval(got["fused_adamw_speedup"]) == pytest.approx({"median": 1.15, "min": 1.1, "max": 1.2, "rounds": 2})
    assert no_interval(got["sdpa_speedup_vs_eager"]) == pytest.approx({"median": 1.15, "min": 1.1, "max": 1.2, "rounds": 2})
    text = "\n".join(bench_report.ratio_lines({"ratios": {"tiny": got}}))
    assert "fused AdamW's speed-up over torch's per-parameter AdamW (recipe, epoch): **1.150x**" in text


def test_lora_row_is_timed_by_round_and_its_state_compared_with_full_fine_tuning(tmp_path, monkeypatch):
    """The `lora` run: the recipe with --use_peft on one process, interleaved with `single`; its speed-up by round,
    its model state beside full fine-tuning's and its own measured / predicted; skipped (with the reason) for a model
    from random init or without peft."""
    def run(name, round_, epoch_s, state=None, ratio=None):
        return dict(bench.Run(model="tiny", name=name, kind="baseline", round=round_).__dict__, epoch_s=epoch_s,
                    state_measured=state, memory_ratio=ratio)

    runs = [run("single", 0, 10.0, 18 * 2**20, 1.0), run("lora", 0, 8.0, 6 * 2**20, 1.006),
            run("single", 1, 12.0), run("lora", 1, 10.0)]
    got = bench_report.ratios(runs)["tiny"]
    assert no_interval(got["lora_speedup_vs_full"]) == pytest.approx({"median": 1.225, "min": 1.2, "max": 1.25, "rounds": 2})
    assert got["lora_state_vs_full"]["ratio"] == pytest.approx(1 / 3)
    text = "\n".join(bench_report.ratio_lines({"ratios": {"tiny": got}}))
    assert "LoRA (r 8) / full fine-tuning, model state per rank: **0.333x** (6.00 / 18.00 MiB; LoRA measured / " \
           "predicted 1.006)" in text
    command = bench.plan_command(bench.Run(model="tiny", name="lora", kind="baseline"), bench.TINY,
                                 bench.PROFILES["quick"], tmp_path, tmp_path, "recipes/cls.py", 0)
    assert command[command.index("--use_peft") + 1:command.index("--use_peft") + 3] == ["--lora_r", str(bench.LORA_R)]
    assert "--config_file" in command and "accelerate_configs/single.yaml" in command
    lora = bench.Run(model="-", name="lora", kind="baseline")
    assert bench.skip_reason(lora, 0, bench.TINY) == ""
    assert "random init" in bench.skip_reason(lora, 0, bench.ModelSpec("base", "x", True, "bf16", 2e-5))
    shape = bench.lora_shape(bench.TINY)
    assert 0 < shape.trainable_params < shape.num_params / 2
    with monkeypatch.context() as patch:
        patch.setattr(bench.importlib.util, "find_spec", lambda name: None)
        assert "pip install -e .[lora]" in bench.skip_reason(lora, 0, bench.TINY)


def test_schedule_interleaves_the_compared_runs_then_runs_the_strategies_once():
    got = bench.schedule_runs(("single", "ddp", "zero2", "dataparallel", "loop", "grouped"), repeats=3)
    assert got == [("grouped", 0), ("single", 0), ("loop", 0), ("loop", 1), ("single", 1), ("grouped", 1),
                   ("grouped", 2), ("single", 2), ("loop", 2), ("ddp", 0), ("zero2", 0), ("dataparallel", 0)]
    assert bench.schedule_runs(("zero2",), repeats=3) == [("zero2", 0)]
    # the quick profile's further rounds run the headline runs alone (pad128 and lora keep their 4 rounds)
    names = ("single", "zero2", "loop", "pad128", "grouped", "lora")
    got = bench.schedule_runs(names, repeats=2, headline_repeats=4)
    assert got[:10] == bench.schedule_runs(names, repeats=2)[:10]
    assert got[10:] == [("grouped", 2), ("single", 2), ("loop", 2), ("loop", 3), ("single", 3), ("grouped", 3),
                       ("zero2", 0)]
    assert bench.schedule_runs(names, repeats=2, headline_repeats=1) == bench.schedule_runs(names, repeats=2)
    quick = bench.PROFILES["quick"]
    every = bench.schedule_runs((*bench.STRATEGIES, *quick.baselines), quick.repeats, quick.headline_repeats)
    rounds = {name: sum(n == name for n, _ in every) for name in ("single", "loop", "trainer", "grouped",
                                                                 "padding_free", "padding_free_grouped", "pad128",
                                                                 "lora", "zero2")}
    assert rounds == {**dict.fromkeys(bench.HEADLINE, 8), "pad128": 4, "lora": 4, "zero2": 1}
    # every run: the pairs of the goals on time launch next to each other, pad128-grouped one apart
    first = [name for name, r in bench.schedule_runs((*bench.STRATEGIES, *bench.BASELINES), 2) if r == 0]
    for a, b, apart in (("padding_free_grouped", "grouped", 1), ("grouped", "single", 1),
                        ("single", "padding_free", 1), ("pad128", "grouped", 2)):
        assert abs(first.index(a) - first.index(b)) == apart, (a, b)


def test_quick_profile_leaves_the_kernel_rows_to_full(monkeypatch):
    """`make bench` (quick) runs every baseline but unfused and eager_attn (decided by BENCH=kernels), BENCH=full
    all of them, and --baselines names its own."""
    seen = []

    class Stop(Exception):
        pass

    def run_bench(profile, strategies, baselines, runs_dir, recipe):
        seen.append(tuple(baselines))
        raise Stop

    monkeypatch.setattr(bench, "run_bench", run_bench)
    for argv in (["--profile", "quick"], ["--profile", "full"], ["--profile", "quick", "--baselines", "unfused"]):
        with pytest.raises(Stop):
            bench.main(argv)
    quick = tuple(name for name in bench.BASELINES if name not in ("unfused", "eager_attn"))
    assert seen == [quick, bench.BASELINES, ("unfused",)] and "lora" in quick and "alternate" in quick


def test_a_tagged_longer_measurement_keeps_the_profile_and_the_page(tmp_path, monkeypatch):
    """--rounds / --alternate_rounds lengthen one measurement without changing the shipped profile, and --tag names
    its files <date>_<tag>_<device>_<host> (which tests/test_docs.py's latest bench is not) and leaves the page."""
    seen = []

    def run_bench(profile, strategies, baselines, runs_dir, recipe):
        seen.append((profile.repeats, profile.headline_repeats, profile.alternate_rounds, tuple(baselines)))
        return fake_results()

    monkeypatch.setattr(bench, "run_bench", run_bench)
    page = tmp_path / "benchmark.md"
    page.write_text(f"{bench_report.README_START}\nold\n{bench_report.README_END}\n")
    bench.main(["--strategies", "single", "--baselines", "loop", "trainer", "--rounds", "16", "--alternate_rounds",
                "12", "--tag", "rounds16", "--results_dir", str(tmp_path / "r"), "--bench_page", str(page)])
    quick = bench.PROFILES["quick"]
    assert seen == [(16, 16, 12, ("loop", "trainer"))]
    assert (quick.repeats, quick.headline_repeats, quick.alternate_rounds) == (4, 8, 6)  # the profile is unchanged
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [f"2026-01-02_rounds16_cpu_box.{ext}"
                                                                  for ext in ("json", "md", "png")]
    saved = json.loads((tmp_path / "r" / "2026-01-02_rounds16_cpu_box.json").read_text())
    assert saved["tag"] == "rounds16" and "--rounds 16" in saved["command"]
    assert "old" in page.read_text()  # the page quotes make bench's own runs only
    for bad in (["--rounds", "0"], ["--alternate_rounds", "-2"], ["--tag", " / "]):  # refused before any run
        with pytest.raises(SystemExit):
            bench.main(bad)
    assert len(seen) == 1


def test_every_run_gets_the_machine_in_threads_and_grouped_gets_its_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "available_cores", lambda: 8)
    assert [bench.threads_of(w) for w in (1, 2, 3, 16)] == [8, 4, 2, 1]
    profile = bench.PROFILES["quick"]
    for name, round_ in (("grouped", 2), ("pad128", 0), ("ddp", 0), ("unfused", 1), ("eager_attn", 3),
                         ("padding_free", 1), ("padding_free_grouped", 2)):
        run = bench.Run(model="tiny", name=name, kind="baseline", round=round_, seed=42 + round_,
                        threads=bench.threads_of(bench.world_of(name, 0)))
        command = bench.plan_command(run, bench.TINY, profile, tmp_path / name, tmp_path, "recipes/cls.py", 0)
        args = dict(zip(command, command[1:]))
        assert args["--seed"] == str(42 + round_) and args["--cpu_threads"] == str(run.threads)
        assert args["--config_file"] == f"accelerate_configs/{'ddp' if name == 'ddp' else 'single'}.yaml"
        assert ("--group_by_length" in command) == (name in ("grouped", "padding_free_grouped"))
        assert ("--padding_free" in command) == name.startswith("padding_free")
        assert ("--pad_to_max_length" in command) == (name == "pad128")
        assert args.get("--optim") == ("adamw_torch" if name == "unfused" else None)  # else the recipe's default
        assert args.get("--attn_implementation") == ("eager" if name == "eager_attn" else None)
        assert "--max_eval_samples" not in command  # the quick profile evaluates the whole validation split
    assert bench.run_env(3, 1)["OMP_NUM_THREADS"] == "3"
    assert [bench.run_env(1, world)[bench.COMM_VARIABLE] for world in (1, 2)] == ["0", "1"]


def test_epoch_figures_take_all_steps_and_the_padded_tokens():
    metrics = [{"elapsed": e, "tokens": t, "padded_tokens": p} for e, t, p in ((1.0, 30, 64), (2.5, 50, 64))]
    assert bench_report.epoch_figures(metrics) == {"epoch_s": 2.5, "padding_efficiency": 80 / 128}
    assert bench_report.epoch_figures([{"elapsed": 3.0, "tokens": 9}])["padding_efficiency"] is None


def test_results_writer_writes_md_json_png_and_the_readme_block(tmp_path):
    results = fake_results()
    paths = bench_report.write_results(results, tmp_path / "results")
    assert {p.name for p in paths.values()} == {f"2026-01-02_cpu_box.{ext}" for ext in ("md", "json", "png")}
    assert json.loads(paths["json"].read_text())["runs"] == results["runs"]
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second bench of the same day keeps the first's files (pages cite them); a --rerender replaces its own
    again = bench_report.write_results(results, tmp_path / "results")
    assert {p.name for p in again.values()} == {f"2026-01-02_cpu_box-2.{ext}" for ext in ("md", "json", "png")}
    assert bench_report.write_results(results, tmp_path / "results", replace=True)["md"] == paths["md"]
    md = paths["md"].read_text()
    main = md.split("## Results", 1)[1].split("## Communication", 1)[0]
    table = [line for line in main.splitlines() if line.startswith("| tiny |")]
    assert table[0] == ("| tiny | single | 1 | 2 | fp32 | 150.0 | 7000 | 0.375 | 0.250 | 0.200 | 17.26 | 17.21 | 1.003 "
                        "| - | - | - | 1097 | 0.610 | 2.5% |")
    assert table[1].startswith("| tiny | fsdp | | | | failed: ValueError: no FSDP on CPU |")
    assert len(table) == 3  # neither round 1 nor the alternate run (ratios only) is in the main table
    assert "tiny, recipe (accelerate launch) / hand-written loop, separate processes: **1.126x** (min 1.053, max " \
           "1.200; 2 interleaved rounds; 95% interval of the median 1.053-1.200, half-width 0.074 (goal <= 0.03: NOT " \
           "met))\n" in md
    assert "recipe / hand-written loop, same process: **0.990x** (min 0.970, max 1.010; 2 blocks of steps taken in " \
           "turn in one process; 95% interval of the median 0.970-1.010, half-width 0.020 (goal <= 0.03: met)) (goal " \
           "<= 1.03: met)" in md and "Trainer / recipe, same process: **1.050x**" in md
    assert "| tiny | 1 | 43 | 12.00 | 10.00 | 0.600 | 0.610 | 2 |" in md  # the rounds table
    assert f"![throughput and memory]({paths['png'].name})" in md

    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{bench_report.README_START}\nold table\n{bench_report.README_END}\nafter\n")
    assert bench_report.update_readme(readme, results, paths)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# Title\n\nbefore\n") and text.endswith("after\n")
    assert "| tiny | single | 1 | 2 | fp32 | 150.0 |" in text and "results/2026-01-02_cpu_box.png" in text
    # the page gives the figures; each goal's verdict stays in the results file it links
    assert "NOT met" in md and "(goal " not in text and "met)" not in text and "disturbed runs" not in text
    assert "recipe / hand-written loop, same process: **0.990x** (min 0.970, max 1.010; 2 blocks of steps taken in " \
           "turn in one process; 95% interval of the median 0.970-1.010)\n" in text
    readme.write_text("# No markers\n")
    assert not bench_report.update_readme(readme, results, paths)
    assert readme.read_text() == "# No markers\n"


def test_rerender_recomputes_throughput_and_ratios_from_the_run_records(tmp_path):
    results = fake_results()
    for run in results["runs"]:
        if run["status"] != "ok":
            continue
        run_dir = tmp_path / f"{run['name']}_{run['round']}"
        run_dir.mkdir()
        run["run_dir"] = str(run_dir)
        step = 0.5 if run["name"] == "single" else 0.4
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"elapsed": 3.0 + i * step, "samples": 32, "tokens": 1000}) + "\n" for i in range(40)))
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    got = bench_report.rerender(path)
    single = next(r for r in got["runs"] if r["name"] == "single")
    assert single["fast_step_time_s"] == pytest.approx(0.5) and single["samples_per_s"] == pytest.approx(64.0)
    assert single["epoch_s"] == pytest.approx(3.0 + 39 * 0.5)
    assert got["ratios"]["tiny"]["recipe_vs_hand_loop_time"]["median"] == pytest.approx(22.5 / 18.6)


@pytest.fixture
def forked_launches(monkeypatch):
    """The bench's launches fork from tests/prewarm.py's server (helpers.python()) in the tests that read their rows,
    not their CPU seconds: a forked launch's ranks are the server's children, which the bench's meter does not see."""
    from helpers import python

    monkeypatch.setattr(bench, "PYTHON", python())


@pytest.mark.multiproc
def test_bench_smoke_on_the_tiny_model(tiny_model, tmp_path, forked_launches):
    """Smoke test: the quick path, cut to 4 steps and one 2-process strategy, produces a complete row."""
    profile = bench.Profile(models=[bench.TINY], steps=4, warmup_steps=1, eval_samples=32, run_timeout=300)
    results = bench.run_bench(profile, strategies=("zero2",), baselines=(), runs_dir=tmp_path / "runs")
    rows = {r["name"]: r for r in results["runs"]}
    assert set(rows) == {"zero2"}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["reason"])
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] > 0 and row["step_time_s"] > 0
        assert abs(row["memory_ratio"] - 1) < 0.10, (name, row["breakdown"])
        assert row["run_config"]["total_optimizer_steps"] == 4 and 0 <= row["accuracy"] <= 1
    assert rows["zero2"]["world"] == 2 and rows["zero2"]["ds_config"]["bf16"]["enabled"] is False


@pytest.mark.multiproc
def test_bench_accepts_another_encoder(encoders, tmp_path, forked_launches):
    """`make bench BENCH_MODEL=<folder>`: a DistilBERT under FSDP2, whose wrapped layers the recipe picks (its
    _no_split_modules is empty); the memory model, told the same classes, predicts the bytes each rank holds."""
    spec = bench.custom_model(str(encoders["distilbert"]))
    assert (spec.name, spec.random_init, spec.precision) == ("distilbert", False, "fp32")
    profile = bench.Profile(models=[spec], steps=4, warmup_steps=1, eval_samples=32, run_timeout=300)
    (row,) = bench.run_bench(profile, strategies=("fsdp",), baselines=(), runs_dir=tmp_path / "runs")["runs"]
    assert row["status"] == "ok", row["reason"]
    assert abs(row["memory_ratio"] - 1) < 0.10, row["breakdown"]
    assert row["run_config"]["config"]["model_name_or_path"] == str(encoders["distilbert"])


def test_baton_takes_turns_in_rotating_order_and_times_no_waiting(monkeypatch):
    """Three loops in threads, blocks of 2 steps after 2 warm-up steps; a fake clock that only the running loop
    advances (by its own cost per step): every timed step must record exactly its loop's cost, never another's."""
    from scripts.measure import bench_baselines

    clock = {"now": 0.0}
    monkeypatch.setattr(bench_baselines.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(bench_baselines.time, "process_time", lambda: clock["now"])  # one thread, always computing
    monkeypatch.setattr(bench_baselines.bench_load, "machine_cpu", lambda: (clock["now"], 2 * clock["now"]))
    cost, steps = {"a": 1.0, "b": 10.0, "c": 100.0}, {"a": 9, "b": 9, "c": 5}
    baton = bench_baselines.Baton(["a", "b", "c"], block=2, warmup=2, timeout=30)
    turns, running = [], []

    def work(name):
        for step in range(1, steps[name] + 1):
            running.append(name)
            assert running == [name], running  # nobody else runs inside a turn
            if step % 2 == 1:  # the first step of a turn
                turns.append(name)
            clock["now"] += cost[name]
            running.remove(name)
            baton.step(name, step)

    threads = [bench_baselines.threading.Thread(target=baton.run, args=(n, lambda n=n: work(n))) for n in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    # cycles rotate a b c, b c a, c a b; c leaves after its 3rd turn (5 steps); then b a, a b
    assert turns == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "b", "a", "a", "b"]
    assert {n: sorted(s) for n, s in baton.seconds.items()} == {
        "a": list(range(3, 10)), "b": list(range(3, 10)), "c": [3, 4, 5]}
    assert all(v == cost[n] for n, s in baton.seconds.items() for v in s.values())
    # blocks every loop finished, last step (the recipe's evaluation) left out: steps 3-4 only (c stops at 5)
    # and the process's CPU over the same stretches, beside the machine's (2 cores, only this process busy)
    assert baton.blocks(last_step=5) == [{"steps": [3, 4], "a": 2.0, "b": 20.0, "c": 200.0, "wall_s": 222.0,
                                          "cpu_s": 222.0, "machine_busy_s": 222.0, "machine_s": 444.0}]


def test_baton_hands_the_turn_on_when_a_loop_fails():
    from scripts.measure import bench_baselines

    baton = bench_baselines.Baton(["bad", "good"], block=1, warmup=0, timeout=30)
    done, errors = [], []

    def bad():
        baton.step("bad", 1)
        raise ValueError("boom")

    def good():
        for step in range(1, 4):
            baton.step("good", step)
        done.append(True)

    def guarded(name, work):
        try:
            baton.run(name, work)
        except ValueError as err:
            errors.append(str(err))

    threads = [bench_baselines.threading.Thread(target=guarded, args=a) for a in (("bad", bad), ("good", good))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == ["boom"] and done == [True] and sorted(baton.seconds["good"]) == [1, 2, 3]


def test_alternate_runs_recipe_loop_and_trainer_on_the_same_batches(tiny_model, tmp_path):
    """The `alternate` run for real, tiny, in bf16: 2 rounds of 8 steps in blocks of 2 after 2 warm-up steps. The
    recipe trains in the run's precision from the first round on (it used to take fp32 until Trainer's Accelerator
    state, shared in the process, came first with bf16)."""
    import subprocess

    from helpers import PYTHON, REPO

    out = tmp_path / "alt"
    subprocess.run([PYTHON, "scripts/measure/bench_baselines.py", "alternate", "--model_name_or_path", str(tiny_model),
                    "--output_dir", str(out), "--max_train_samples", "64", "--batch_size", "8", "--rounds", "2",
                    "--block", "2", "--warmup_steps", "2", "--max_eval_samples", "16", "--precision", "bf16"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    got = json.loads((out / "alternate.json").read_text())
    assert got["same_batches"] is True and got["block_steps"] == 2 and got["rounds"] == 2
    # steps 3..7 timed (8 is the last), in blocks 3-4, 5-6 and 7: per round 3 blocks
    expected = [(r, s) for r in (0, 1) for s in ([3, 4], [5, 6], [7, 7])]
    assert [(b["round"], b["steps"]) for b in got["blocks"]] == expected
    assert all(b[n] > 0 for b in got["blocks"] for n in ("recipe", "loop", "trainer"))
    for r in (0, 1):  # the recipe really ran, as a user's run: its records, every step, in bf16
        assert len([json.loads(x) for x in (out / f"recipe_r{r}" / "metrics.jsonl").read_text().splitlines()]) == 8
        assert json.loads((out / f"recipe_r{r}" / "run_config.json").read_text())["mixed_precision"] == "bf16"


def test_cpu_share_of_a_real_launch(tmp_path):
    """A one-thread busy loop of 1 s uses its CPU (share near 1), unless other work took the machine's cores, which
    others' share then shows; a sleep uses none: its share is its interpreter's start-up alone (0.03-0.11 s of CPU,
    more on a loaded machine, so no fixed bound holds it). The CPU seconds are the child's own, as it counts them."""
    profile = bench.Profile(models=[bench.TINY], run_timeout=60)
    got, others, startup = {}, {}, {}
    for name, code in (("busy", "end = time.time() + 1.0\nwhile time.time() < end: pass"),
                       ("sleep", "time.sleep(1.0)")):
        run = bench.Run(model="tiny", name=name, kind="baseline", threads=1)
        (tmp_path / name).mkdir()
        script = f"import time\nprint(time.process_time())\n{code}\nprint(time.process_time())"
        samples = bench.execute(run, [bench.PYTHON, "-c", script], tmp_path / name, profile, dict(bench.os.environ))
        bench.record_load(run, samples)
        startup[name], own = map(float, (tmp_path / name / "launch.log").read_text().split()[-2:])
        assert run.status == "ok" and run.cpu_s == pytest.approx(own, abs=0.05)
        assert run.others_share is not None and 0 <= run.others_share <= 1
        got[name], others[name] = run.cpu_share, run.others_share
        if name == "sleep":
            assert own - startup[name] < 0.01, (own, startup)  # the sleep itself took no CPU
            assert run.cpu_share == pytest.approx(startup[name] / run.wall_s, abs=0.05 / run.wall_s)
    assert got["busy"] > 0.8 or others["busy"] > 0.25, (got, others)
    assert got["sleep"] < got["busy"] / 3 or others["busy"] > 0.25, (got, others)


def test_others_share_takes_the_worst_stretch_as_long_as_the_epoch():
    # (seconds, own CPU, machine busy, machine all) on 2 cores: others take a whole core over seconds 2-4 only
    samples = [(t, 1.0 * t, 1.0 * t + (min(max(t - 2, 0), 2)), 2.0 * t) for t in range(9)]
    assert bench_load.others_share(samples) == pytest.approx(2 / 16)
    assert bench_load.others_share(samples, 2.0) == pytest.approx(0.5)
    assert bench_load.others_share(samples, 100.0) == pytest.approx(2 / 16)  # longer than the launch: all of it


def fake_bench(monkeypatch, tmp_path, disturbed: dict, strategies=(), baselines=("pad128", "grouped"),
               figures=None) -> tuple:
    """run_bench on `strategies` and `baselines` (pad128 and grouped), 4 rounds, without launching: each run's epoch is
    pad128 10 s x (1 + round / 100) and grouped 5 s x (1 + round / 50), or where `figures` maps (name, round) to
    (epoch s, padded tokens per step, accuracy), that, its records counting 300 real tokens per step; `disturbed` maps
    (name, round, attempt) to (epoch factor, CPU share, others' share) for the attempts that other work slowed (every
    other one: share 0.9, others 0.02). Each run's command is planned as run_one plans it (bench.plan_command)."""
    launched = []

    def run_one(spec, name, round_, profile, runs_dir, recipe, n_gpus, shape, peaks, attempt=0):
        slow, share, others = disturbed.get((name, round_, attempt), (1.0, 0.9, 0.02))
        epoch = (10.0 * (1 + round_ / 100) if name == "pad128" else 5.0 * (1 + round_ / 50))
        step = {"samples": 16, "tokens": 100}
        accuracy = 0.5
        if figures and (name, round_) in figures:
            epoch, padded, accuracy = figures[(name, round_)]
            step = {"samples": 16, "tokens": 300, "padded_tokens": padded}
        epoch *= slow
        run_dir = tmp_path / f"{name}_r{round_}_a{attempt}"
        run_dir.mkdir()
        metrics = [{"elapsed": epoch * (i + 1) / 4, **step} for i in range(4)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        launched.append((name, round_, attempt))
        run = bench.Run(model="tiny", name=name, kind="baseline", round=round_, seed=42 + round_, attempt=attempt,
                        world=1, threads=2, epoch_s=epoch, cpu_share=share, others_share=others / 2,
                        others_peak=others, accuracy=accuracy, run_dir=str(run_dir),
                        padding_efficiency=bench_report.epoch_figures(metrics)["padding_efficiency"])
        run.command = bench.plan_command(run, spec, profile, run_dir, runs_dir, recipe, n_gpus)
        return run

    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(bench, "visible_gpus", lambda: 0)
    monkeypatch.setattr(bench.memory_model, "shape_from_model", lambda path, lora_r=None: bench.memory_model.ModelShape(1))
    monkeypatch.setattr(bench, "padding_costs", lambda spec, profile: {})
    profile = bench.Profile(models=[bench.TINY], steps=4, warmup_steps=1, repeats=4)
    logged = []
    results = bench.run_bench(profile, strategies=strategies, baselines=baselines, runs_dir=tmp_path,
                              log=logged.append)
    results["command"] = "test"
    return results, launched, logged


def test_a_disturbed_run_is_repeated_and_set_aside_when_it_stays_disturbed(monkeypatch, tmp_path):
    """grouped#2 is slowed 3x with others' CPU at 0.5 in all 3 launches: set aside. grouped#3's first launch is slowed
    alike, its repeat not. pad128#1's first launch lost CPU to another cgroup (share 0.6 of its best 0.9, others
    unseen): launched again. The speed-up is the median of rounds 0, 1 and 3, undisturbed; taking every first launch
    as it came would give the median of 2.0, 1.98, 0.65 and 0.65 (1.32)."""
    slowed = {("grouped", 2, a): (3.0, 0.9, 0.5) for a in range(3)}
    slowed[("grouped", 3, 0)] = (3.0, 0.9, 0.5)
    slowed[("pad128", 1, 0)] = (1.5, 0.6, 0.02)
    results, launched, logged = fake_bench(monkeypatch, tmp_path, slowed)
    assert launched == [("pad128", 0, 0), ("grouped", 0, 0), ("grouped", 1, 0), ("pad128", 1, 0), ("pad128", 1, 1),
                        ("pad128", 2, 0), ("grouped", 2, 0), ("grouped", 2, 1), ("grouped", 2, 2), ("grouped", 3, 0),
                        ("grouped", 3, 1), ("pad128", 3, 0)]
    undisturbed = [2 * (1 + r / 100) / (1 + r / 50) for r in (0, 1, 3)]
    speedup = dict(results["ratios"]["tiny"]["grouped_speedup_vs_pad128"])
    assert speedup.pop("set_aside") == [2]
    assert no_interval(speedup) == pytest.approx({"median": undisturbed[1], "min": undisturbed[2], "max": undisturbed[0],
                                     "rounds": 3})
    text = "\n".join(bench_report.ratio_lines(results))
    assert "grouped batches' speed-up over pad-to-128: **1.980x** (min 1.943, max 2.000; 3 interleaved rounds, 1 set " \
           "aside as disturbed: 2; 95% interval of the median 1.943-2.000)" in text
    assert "disturbed runs launched again (4): pad128#1: CPU share 0.60 < 0.85 x 0.90; grouped#2: others' CPU 0.50 " \
           "of the machine > 0.1; grouped#2 (repeat 1): others' CPU 0.50 of the machine > 0.1; grouped#3: " in text
    assert "disturbed runs still disturbed, set aside (1): grouped#2 (repeat 2): others' CPU 0.50" in text
    assert any("grouped#2 (repeat 1) disturbed" in line and line.endswith(": again") for line in logged)
    md = bench_report.render_markdown(results, "chart.png")
    assert "| tiny | 2 | 44 | 10.20 | 15.60 | 0.500 | 0.500 | 2 | grouped |" in md  # the rounds table: last attempts
    # --rerender: the same rule on the stored figures, throughput recomputed from the run records
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    again = bench_report.rerender(path)
    assert again["ratios"]["tiny"] == results["ratios"]["tiny"]
    assert again["ratios"]["tiny"]["disturbed"] == results["ratios"]["tiny"]["disturbed"]


def test_an_undisturbed_bench_launches_each_run_once(monkeypatch, tmp_path):
    results, launched, _ = fake_bench(monkeypatch, tmp_path, {})
    assert len(launched) == 8
    assert bench_report.ratio_lines(results)[-1].startswith("- tiny, disturbed runs: none (disturbed: CPU share")


def test_padding_free_rows_are_interleaved_beside_dynamic_and_grouped_and_reported(monkeypatch, tmp_path):
    """`padding_free` (--padding_free) and `padding_free_grouped` (--padding_free --group_by_length): the recipe on one
    process, launched in the interleaved rounds next to the run each is compared with (single, grouped), odd rounds
    backwards. From given epochs, real / padded tokens and accuracies: the speed-up over dynamic padding beside its
    bound P/R (single's padded / real tokens of the same round) and the fraction reached, round by round; grouped /
    padding-free grouped; the real / computed positions of the padding-free runs, from their records; the accuracy
    difference, without a goal."""
    single_padded = {0: 800, 1: 750, 2: 800, 3: 750}  # real / padded 0.375, 0.4: bound 2.667, 2.5
    free_epoch = {0: 5.0, 1: 4.8, 2: 5.2, 3: 6.0}  # speed-up 2.4, 2.5, 2.308, 2.0
    free_grouped_epoch = {0: 4.0, 1: 4.2, 2: 4.1, 3: 3.9}  # grouped 4 s: 1.0, 0.952, 0.976, 1.026
    accuracy = {0: (0.600, 0.604), 1: (0.610, 0.612), 2: (0.590, 0.588), 3: (0.620, 0.620)}  # single, padding_free
    figures = {}
    for r in range(4):
        figures.update({("single", r): (12.0, single_padded[r], accuracy[r][0]),
                        ("padding_free", r): (free_epoch[r], 300, accuracy[r][1]),
                        ("grouped", r): (4.0, 400, 0.58),
                        ("padding_free_grouped", r): (free_grouped_epoch[r], 300, 0.58)})
    results, launched, _ = fake_bench(monkeypatch, tmp_path, {}, strategies=("single",),
                                      baselines=("grouped", "padding_free", "padding_free_grouped"), figures=figures)
    order = ["padding_free_grouped", "grouped", "single", "padding_free"]
    assert launched == [(name, r, 0) for r in range(4) for name in (order[::-1] if r % 2 else order)]
    for run in results["runs"]:
        command = run["command"]
        args = dict(zip(command, command[1:]))
        assert args["--config_file"] == "accelerate_configs/single.yaml" and args["--num_processes"] == "1"
        assert args["--seed"] == str(42 + run["round"])
        assert ("--padding_free" in command) == run["name"].startswith("padding_free"), run["name"]
        assert ("--group_by_length" in command) == run["name"].endswith("grouped"), run["name"]

    got = results["ratios"]["tiny"]
    assert no_interval(got["padding_free_speedup_vs_dynamic"]) == pytest.approx(
        {"median": (12 / 5.2 + 2.4) / 2, "min": 2.0, "max": 2.5, "rounds": 4})
    assert got["padding_free_bound"] == pytest.approx({"median": (8 / 3 + 2.5) / 2, "min": 2.5, "max": 8 / 3,
                                                       "rounds": 4})
    # speed-up x real / padded: 2.4 x 0.375, 2.5 x 0.4, 2.308 x 0.375, 2.0 x 0.4
    assert no_interval(got["padding_free_fraction_of_bound"]) == pytest.approx(
        {"median": (0.9 + 12 / 5.2 * 0.375) / 2, "min": 0.8, "max": 1.0, "rounds": 4})
    assert no_interval(got["padding_free_grouped_vs_grouped"]) == pytest.approx(
        {"median": (4 / 4.1 + 1.0) / 2, "min": 4 / 4.2, "max": 4 / 3.9, "rounds": 4})
    assert got["padding_free_real_vs_computed"] == {
        name: {"median": 1.0, "min": 1.0, "max": 1.0, "rounds": 4} for name in ("padding_free", "padding_free_grouped")}
    diff = got["padding_free_minus_dynamic_accuracy_points"]
    assert diff == pytest.approx({"median": 0.1, "min": -0.2, "max": 0.4, "rounds": 4, "mean": 0.1})
    assert got["accuracy"]["padding_free"] == [0.604, 0.612, 0.588, 0.620]

    text = "\n".join(bench_report.ratio_lines(results))
    assert "- tiny, padding-free batches' speed-up over dynamic padding: **2.354x** (min 2.000, max 2.500; 4 " \
           "interleaved rounds; 95% interval of the median 2.000-2.500)\n" in text
    assert "- tiny, bound of that speed-up, P/R: positions dynamic padding computes / real tokens: **2.583x** (min " \
           "2.500, max 2.667; 4 interleaved rounds)\n" in text
    assert "- tiny, padding-free batches' speed-up / its bound P/R: **0.883x** (min 0.800, max 1.000; 4 interleaved " \
           "rounds; 95% interval of the median 0.800-1.000) (goal >= 0.85: met)\n" in text
    assert "- tiny, padding-free grouped batches' speed-up over grouped batches: **0.988x** (min 0.952, max 1.026; 4 " \
           "interleaved rounds; 95% interval of the median 0.952-1.026) (goal >= 0.97: met)\n" in text
    assert "- tiny, padding-free - dynamic accuracy: **+0.10 points** mean (min -0.20, max +0.40; 4 rounds; dropout " \
           "draws differently)\n" in text
    assert "- tiny, real / computed positions of the padding-free runs (tokens / padded_tokens of their records): " \
           "padding_free 1.000 (4 rounds), padding_free_grouped 1.000 (4 rounds) (expected 1.000: met)\n" in text
    table = bench_report.markdown_table(results)
    assert "| tiny | padding_free | 1 | 2 | fp32 | - | - | 1.000 |" in table
    assert "| tiny | single | 1 | 2 | fp32 | - | - | 0.375 |" in table
    # --rerender: the same figures from the runs' records
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert bench_report.rerender(path)["ratios"]["tiny"] == got
    # a padding-free run that computed padding positions, and a round whose padding_free run is missing
    runs = [r for r in results["runs"] if not (r["name"] == "padding_free" and r["round"] == 3)]
    runs = [dict(r, padding_efficiency=0.99) if r["name"] == "padding_free_grouped" and r["round"] == 1 else r
            for r in runs]
    got = bench_report.ratios(runs)["tiny"]
    assert got["padding_free_bound"]["rounds"] == got["padding_free_fraction_of_bound"]["rounds"] == 3
    assert got["padding_free_real_vs_computed"]["padding_free_grouped"]["min"] == 0.99
    assert "padding_free_grouped 0.990-1.000 (4 rounds) (expected 1.000: NOT met)" in "\n".join(
        bench_report.ratio_lines({"ratios": {"tiny": got}}))


def test_same_process_ratios_leave_out_disturbed_blocks():
    """Blocks of the `alternate` run on 2 threads: the third had others' CPU at 0.3 of the machine, the fourth only
    0.5 of the CPU share the best block reached; both are left out, and the ratios are the other blocks'."""
    def block(i, recipe, share, others):
        wall = recipe + 1.0 + 1.0
        return {"round": 0, "steps": [11 + 5 * i, 15 + 5 * i], "recipe": recipe, "loop": 1.0, "trainer": 1.0,
                "wall_s": wall, "cpu_s": share * wall * 2, "machine_busy_s": share * wall * 2 + others * wall * 2,
                "machine_s": wall * 2}

    blocks = [block(0, 1.02, 0.95, 0.0), block(1, 1.01, 0.9, 0.01), block(2, 2.0, 0.95, 0.3), block(3, 1.5, 0.5, 0.0),
              block(4, 1.03, 0.93, 0.02)]
    runs = [dict(bench.Run(model="tiny", name="alternate", kind="baseline", threads=2).__dict__, alternate=blocks)]
    got = bench_report.ratios(runs)["tiny"]
    same = got["recipe_vs_hand_loop_same_process"]
    assert same.pop("set_aside") == ["0:21-25", "0:26-30"]
    assert no_interval(same) == pytest.approx({"median": 1.02, "min": 1.01, "max": 1.03, "rounds": 3})
    text = "\n".join(bench_report.ratio_lines({"ratios": {"tiny": got}}))
    assert "disturbed same-process blocks, out of the ratios: 2 of 5: round 0 steps 21-25: others' CPU 0.30 of the " \
           "machine > 0.1; round 0 steps 26-30: CPU share 0.50 < 0.85 x 0.95" in text
    # a machine busy throughout: every block disturbed; the figures of all of them, marked as not to be trusted
    busy = [dict(b, cpu_s=b["cpu_s"] / 2, machine_busy_s=b["machine_s"]) for b in blocks]
    got = bench_report.ratios([dict(runs[0], alternate=busy)])["tiny"]["recipe_vs_hand_loop_same_process"]
    assert got["all_disturbed"] and got["rounds"] == 5 and got["median"] == pytest.approx(1.03)
    assert "every one disturbed, so all kept: not to be trusted" in bench_report.ratio_lines(
        {"ratios": {"tiny": {"recipe_vs_hand_loop_same_process": got}}})[0]


def test_mfu_divides_by_every_device_the_run_computed_on():
    """A 2-process CPU run has two processes' peaks (each measured on its own threads); nn.DataParallel on 4 GPUs
    computes on 4 GPUs from one process. Counting a CPU run as one device put the 2-process rows above 100%."""
    assert bench.compute_devices(world=2, effective_batch=32, per_device_batch=16, on_gpus=False) == 2
    assert bench.compute_devices(world=1, effective_batch=16, per_device_batch=16, on_gpus=False) == 1
    assert bench.compute_devices(world=1, effective_batch=64, per_device_batch=16, on_gpus=True) == 4
    assert bench.compute_devices(world=8, effective_batch=128, per_device_batch=16, on_gpus=True) == 8


def test_startup_bench_times_each_side_to_its_first_step_and_stops_it(tmp_path):
    """scripts/measure/bench_startup.py on a 96-row cut of its data, one cold launch of each side: each side's clock
    stops at its first record, written after the first optimizer step (the recipe's, the loop's and the Trainer's, at
    the loss of an untrained 2-class head), and the launch is stopped there (the recipe's 2-step run never saves
    final/)."""
    import math

    from scripts.measure import bench_startup

    data = tmp_path / "data"
    assert bench_startup.write_data(data, limit=96) == {"train": 96, "validation": 96}
    env = {**bench.run_env(2, 1), "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    for side in bench_startup.SIDES:
        out = tmp_path / side
        seconds = bench_startup.time_to_first_step(bench_startup.command(side, data, out), out, env)
        first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        print(f"{side}: first step after {seconds:.1f} s, loss {first['loss']:.4f}")
        assert seconds > 0 and first["step"] == 1 and abs(first["loss"] - math.log(2)) < 0.1
        assert not (out / "final").exists()
    # the three cold launches filled the cache a warm launch reads: the CSV conversions and the tokenizing maps
    assert len(list((tmp_path / "cache").rglob("*.arrow"))) >= 3


def test_startup_ratios_pair_the_sides_within_each_round():
    from scripts.measure import bench_startup

    times = {"recipe": {"cold": [10.0, 12.0, 11.0], "warm": [6.0, 6.6, 6.3]},
             "loop": {"cold": [8.0, 12.0, 10.0], "warm": [6.0, 6.0, 6.0]},
             "trainer": {"cold": [10.0, 10.0, 11.0], "warm": [6.0, 6.0, 7.0]}}
    got = bench_startup.ratios(times)
    assert got["recipe / trainer, cold cache"]["per_round"] == [1.0, 1.2, 1.0]
    assert got["recipe / trainer, cold cache"]["median"] == 1.0 and got["recipe / loop, cold cache"]["max"] == 1.25
    assert got["recipe / loop, warm cache"]["per_round"] == pytest.approx([1.0, 1.1, 1.05])
    ci = got["recipe / loop, warm cache"]["ci95"]
    assert ci[0] < 1.05 < ci[1] and got["recipe / loop, warm cache"]["mean"] == pytest.approx(1.05)
    assert "| recipe / loop, warm cache | 1.050 | 1.000-1.100 |" in bench_startup.render(
        {"date": "d", "rounds": 3, "threads": 2, "rows": {"train": 1, "validation": 1}, "seconds": times,
         "ratios": got, "took_min": 1.0})


def test_kernel_bench_compares_sides_that_compute_the_same(tmp_path, monkeypatch):
    """`make bench BENCH=kernels` on the tiny model, 2 block pairs of 2 micro-batches and 10 optimizer steps (the bench
    times 8 and 50): SDPA and eager give the same logits (fp32, eval), fused and default AdamW the same first step, so
    the ratios time implementations of one computation; every pair gives a ratio, the summary is their mean and t
    interval, and the page shows each verdict."""
    from scripts.measure import bench_kernels

    folder, random_init, size, _, _ = bench_kernels.MODELS["tiny"]
    monkeypatch.setitem(bench_kernels.MODELS, "tiny", (folder, random_init, size, 2, 10))
    assert bench_kernels.main(["--models", "tiny", "--pairs", "2", "--results", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_kernels_*.json")
    result = json.loads(path.read_text())
    (row,) = result["rows"]
    assert row["model"] == "tiny" and row["parameters"] > 1e6 and result["pairs"] == 2
    assert (row["micro_batches_per_block"], row["optimizer_steps_per_block"]) == (2, 10)
    assert row["max_abs_logit_diff_eval"] < 1e-5 and row["max_abs_param_diff_one_step"] < 1e-6
    for key in ("sdpa_speedup_over_eager", "fused_speedup_over_default"):
        stats = row[key]
        assert len(stats["per_pair"]) == stats["n"] == 2 and all(r > 0 for r in stats["per_pair"])
        assert stats["mean"] == pytest.approx(sum(stats["per_pair"]) / 2)
        assert stats["ci95"][0] < stats["mean"] < stats["ci95"][1]
    table = path.with_suffix(".md").read_text().splitlines()[-1]
    assert table.startswith("| tiny | 1.5 M |") and table.count("faster") + table.count("slower") + \
        table.count("not decided") == 2


def test_host_pieces_time_the_recipes_step_log_at_every_step(tmp_path):
    """scripts/measure/bench_host.py (docs/speed.md "Per step"): every piece gets a figure, and the StepLog it times
    really logs each call as a step, with the batch's tokens and the loss over the samples. The figures themselves are
    timings, for the doc, not asserted here."""
    us = bench_host.pieces(number=40, repeat=2, folder=tmp_path)
    assert set(us) == {"StepLog, TensorBoard on", "accelerator.log, 3 scalars to TensorBoard", "the loop's record",
                       "AcceleratedOptimizer step + zero_grad, over the optimizer's",
                       "is_lomo_available (twice in each AcceleratedOptimizer.step)",
                       "the prepared loader per batch, over the loader's", "accelerator.accumulate",
                       "AcceleratedScheduler step + get_last_lr, over the scheduler's",
                       "optimizer_step.clip_gradients, over clip_grad_norm_"}
    assert all(math.isfinite(v) for v in us.values())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 81))  # 2 timings of 40 calls: every call one step
    assert {(s["tokens"], s["padded_tokens"], s["samples"]) for s in steps} == {(640, 640, 16)}
    assert [s["loss"] for s in steps] == pytest.approx([0.7 / 16] * 80)
