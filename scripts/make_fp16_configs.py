"""Write the fp16 twin of every bf16 DeepSpeed JSON: ds_configs/<name>.json -> ds_configs/<name>_fp16.json.

    python scripts/make_fp16_configs.py            # (re)write the twins
    python scripts/make_fp16_configs.py --check    # exit 1 if a twin differs from what this script writes

For GPUs without bf16 (compute capability < 8.0: V100, T4). A twin is its bf16 JSON with the "bf16" block replaced
by an "fp16" block with dynamic loss scaling, in the same place, and "data_types" dropped: its fp32 gradient
accumulation is a bf16 setting (DeepSpeed 0.19.8, `DeepSpeedEngine._do_optimizer_sanity_check`, acts on it for bf16
at ZeRO-1 only and refuses fp16 with fp32 accumulation without ZeRO). Everything else is copied, so the twins never
drift from the bf16 files: edit the bf16 JSON, then run this script (tests/test_tutorials.py fails while
a twin is stale).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DS_DIR = REPO_ROOT / "ds_configs"

# DeepSpeed's dynamic loss scaling: start at 2^16, halve on an overflow (the step is skipped), double after
# loss_scale_window clean steps, never below min_loss_scale. "loss_scale": 0 means dynamic.
FP16_BLOCK = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
              "hysteresis": 2, "min_loss_scale": 1}


def bf16_sources(ds_dir: Path = DS_DIR) -> list[Path]:
    """The JSONs that enable bf16 (the twins themselves enable fp16)."""
    return [p for p in sorted(ds_dir.glob("*.json"))
            if json.loads(p.read_text()).get("bf16", {}).get("enabled") is True]


def fp16_twin(bf16_config: dict) -> dict:
    """The fp16 config of a bf16 config: same keys in the same order, "bf16" -> "fp16", no "data_types"."""
    twin = {}
    for key, value in bf16_config.items():
        if key == "bf16":
            twin["fp16"] = dict(FP16_BLOCK)
        elif key != "data_types":
            twin[key] = value
    return twin


def twin_path(source: Path) -> Path:
    return source.with_name(f"{source.stem}_fp16.json")


def render(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a stale or missing twin")
    args = parser.parse_args(argv)
    stale = []
    for source in bf16_sources():
        target, text = twin_path(source), render(fp16_twin(json.loads(source.read_text())))
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target.relative_to(REPO_ROOT).as_posix())
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(REPO_ROOT)}")
    if stale:
        print(f"stale fp16 twins (run python scripts/make_fp16_configs.py): {', '.join(stale)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
