"""predictions.jsonl written as the rows are predicted, each row once and in input order, continued after a kill.

While a prediction runs its lines go to predictions.jsonl.partial (the name says it is unfinished), a window of rows
at a time, flushed; predict_run.json beside it names what is predicted (model, input, settings). When the last row is
written the file becomes predictions.jsonl (one rename) and predict_run.json records the finished prediction. A
later command with the same --output_dir:
- finds predictions.jsonl: refused, unless --overwrite_output_dir (the folder's predictions are then started afresh);
- finds a partial file of the same prediction: continues after its last whole line (a line the kill cut is dropped);
- finds one of another prediction (other model, input or settings): refused, unless --overwrite_output_dir.
The lines are the recipe's predictions.jsonl records (recipes/outputs/predict.py), written on the main process.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from recipes import RecipeError

FINAL = "predictions.jsonl"
PARTIAL = "predictions.jsonl.partial"
RECORD = "predict_run.json"


def resume_point(out: Path, binding: dict, overwrite: bool) -> int:
    """Make `out` ready for the prediction `binding` describes; the rows already written (0: from the start)."""
    final, partial, record = out / FINAL, out / PARTIAL, out / RECORD
    if overwrite:
        for path in (final, partial, record):
            path.unlink(missing_ok=True)
    if final.exists():
        raise RecipeError(f"{final} holds a finished prediction: --overwrite_output_dir replaces it")
    if partial.exists():
        earlier = read_record(record)
        if earlier is None or earlier.get("binding") != binding:
            changed = sorted(k for k in binding if (earlier or {}).get("binding", {}).get(k) != binding[k])
            raise RecipeError(f"{partial} is an unfinished prediction of another model, input or settings "
                              f"({', '.join(changed) or 'no record of them'} differ): run the same command to "
                              "continue it, or --overwrite_output_dir to start afresh")
        return whole_lines(partial)
    out.mkdir(parents=True, exist_ok=True)
    partial.touch()
    record.write_text(json.dumps({"complete": False, "binding": binding}, indent=2) + "\n")
    return 0


def read_record(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def whole_lines(partial: Path) -> int:
    """The lines of `partial` that are whole records of rows 0, 1, ...; the file is cut after the last of them."""
    count, keep = 0, 0
    with open(partial, "rb") as f:
        for line in f:
            try:
                row = json.loads(line)["row"] if line.endswith(b"\n") else None
            except (ValueError, KeyError, TypeError):
                row = None
            if row != count:
                break
            count, keep = count + 1, keep + len(line)
    if keep != partial.stat().st_size:
        os.truncate(partial, keep)
    return count


class Writer:
    """Appends each window's lines to the partial file and flushes them: a kill loses at most the window it cut."""

    def __init__(self, out: Path):
        self.out = out
        self.file = open(out / PARTIAL, "a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.file.flush()

    def finish(self, record: dict) -> Path:
        """The partial file becomes predictions.jsonl; predict_run.json records the finished prediction."""
        self.file.close()
        os.replace(self.out / PARTIAL, self.out / FINAL)
        (self.out / RECORD).write_text(json.dumps({"complete": True, **record}, indent=2) + "\n")
        return self.out / FINAL
