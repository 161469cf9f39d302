"""--padding_free (recipes/model/padding_free.py): exact per sequence, on every strategy, with resume and evaluation.

In-process: every accepted architecture's packed logits (and gradients) against the padded model's, and proof that
the comparison catches the two bugs users report (RoBERTa's positions counted from 0, sequences that see each
other). Launched (10 runs of the dropout-free tiny model): dynamic padding on DDP as the reference; padding-free on
one process (its rows rounded up to a multiple of 8), DDP, FSDP2, ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload
(DeepSpeed's CPU Adam, in AdamW mode) with accumulation and a partial last window; a mid-epoch resume; with
--group_by_length on one process against grouped dynamic padding.
"""
from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from helpers import fp32_launch_args, losses, rank_records, read_jsonl, run_recipe
from recipes import RecipeError
from recipes.model import padding_free

# Measured here (torch 2.13 CPU, float32): the packed and padded logits agree to 0.0 for every architecture below
# in one length group (the same matmuls on the same rows), within 1.9e-9 with a group per length, within 7.5e-8 on the
# varlen path's layout (per-sequence SDPA standing in for CUDA's kernel); the bound allows float32 reordering on
# other machines. A 0-based RoBERTa moves the logits by about 1e-2, one row attending to all the others by about 7e-5.
LOGITS_ATOL = 1e-5
ARCHS = ["bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "albert", "modernbert"]
PAIRS = {"bert", "electra", "albert"}  # token type vocabularies of 2: the second segment gets type 1
LENGTHS = [5, 13, 2, 9]  # longer than ModernBERT's local window below (8), so its sliding layers are exercised


def tiny(arch: str):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    extra = {"albert": dict(classifier_dropout_prob=0.0),
             "distilbert": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0,
                                seq_classif_dropout=0.0),
             "modernbert": dict(local_attention=8, global_attn_every_n_layers=2, embedding_dropout=0.0,
                                mlp_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)}.get(arch, {})
    config = AutoConfig.for_model(arch, **sizes, **extra)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa"), config


def batches(config, arch: str, start: int, multiple: int = 0):
    """The same 4 sequences padded (with an attention mask) and packed (the recipe's collator; `multiple`: the row
    rounded up to a multiple of it by a filler sequence)."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in LENGTHS]
    types_ = [[0] * (n // 2) + [1] * (n - n // 2) for n in LENGTHS]
    longest, pad = max(LENGTHS), config.pad_token_id or 0
    padded = {"input_ids": torch.tensor([s + [pad] * (longest - len(s)) for s in seqs]),
              "attention_mask": torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in seqs])}
    features = [{"input_ids": s, "labels": i % 3, "row": i} for i, s in enumerate(seqs)]
    if arch in PAIRS:
        padded["token_type_ids"] = torch.tensor([t + [0] * (longest - len(t)) for t in types_])
        for f, t in zip(features, types_):
            f["token_type_ids"] = t
    packed = padding_free.PackingCollator(start, "sample_ids", multiple, pad)(features)
    return padded, packed, torch.tensor([f["labels"] for f in features])


def flags_on(multiple: int = 0):
    """The flags padding_free.apply reads: --padding_free, and --pad_to_multiple_of `multiple` when given."""
    return types.SimpleNamespace(padding_free=True, attn_implementation=None, pad_to_multiple_of=multiple or None)


ON = flags_on()


def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
    """torch's varlen_attn (CUDA only) as per-sequence SDPA on CPU, with its argument contract checked: (R, heads, d)
    in and out, int32 boundaries covering every position, host ints bounding the longest (equal to it unless the row
    is rounded up)."""
    assert q.dim() == 3 and q.shape == k.shape == v.shape and cu_q.dtype == torch.int32 and cu_q is cu_k
    assert int(cu_q[-1]) == q.shape[0] and isinstance(max_q, int) and max_q == max_k
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max())
    bounds = cu_q.tolist()
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1) for x in (q, k, v)), scale=scale).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])])


@pytest.mark.parametrize("multiple", [0, 8])
@pytest.mark.parametrize("groups", ["one", "per_length", "varlen"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_logits_and_gradients_equal_the_padded_model(arch, groups, multiple, monkeypatch):
    # "one": the default cost keeps these short sequences in one group; "per_length": every length its own group;
    # "varlen": the CUDA path's layout, its kernel stood in for (ModernBERT's sliding layers stay on the groups);
    # multiple 8 (--pad_to_multiple_of 8): the 29 tokens rounded up to 32 by a filler sequence of 3, its own group
    monkeypatch.setattr(padding_free, "GROUP_OVERHEAD", 0 if groups == "per_length" else padding_free.GROUP_OVERHEAD)
    assert len(padding_free.length_groups(LENGTHS)) == (len(LENGTHS) if groups == "per_length" else 1)
    calls = []
    if groups == "varlen":
        monkeypatch.setattr(padding_free, "_VARLEN", lambda *a, **k: calls.append(1) or varlen_stand_in(*a, **k))
        monkeypatch.setattr(padding_free, "_takes_varlen", lambda query, dropout, window: window is None)
    model, config = tiny(arch)
    padded, packed, labels = batches(config, arch, padding_free.first_position(config), multiple)
    assert packed.pop("labels").tolist() == labels.tolist() and packed.pop("row").tolist() == [0, 1, 2, 3]
    assert packed["input_ids"].shape[1] == (32 if multiple else sum(LENGTHS))
    reference = {}
    for mode in ("eval", "train"):  # no dropout: train mode computes the same numbers
        getattr(model, mode)()
        model.zero_grad()
        logits = model(**padded).logits
        torch.nn.functional.cross_entropy(logits, labels).backward()
        reference[mode] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}
    padding_free.apply(flags_on(multiple), model)
    for mode in ("eval", "train"):
        getattr(model, mode)()
        model.zero_grad()
        logits = model(**packed).logits
        torch.nn.functional.cross_entropy(logits, labels).backward()
        ref_logits, ref_grads = reference[mode]
        delta = (logits - ref_logits).abs().max().item()
        print(f"{arch} {mode}: max |logit diff| {delta:.2e}")
        assert logits.shape == (len(LENGTHS), 3) and delta <= LOGITS_ATOL
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys()
        assert max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) <= LOGITS_ATOL
    # varlen: every layer's attention of both packed passes (ModernBERT: its global layer only)
    assert len(calls) == (0 if groups != "varlen" else 2 * (1 if arch == "modernbert" else config.num_hidden_layers))
    model.eval()  # a padded batch still runs as before through the registered attention (sdpa without boundaries)
    assert (model(**padded).logits - reference["eval"][0]).abs().max().item() <= LOGITS_ATOL


def test_the_logits_test_catches_zero_based_positions_and_sequences_that_see_each_other(monkeypatch):
    model, config = tiny("roberta")
    model.eval()
    padded, packed, _ = batches(config, "roberta", padding_free.first_position(config))
    zero_based = batches(config, "roberta", 0)[1]
    for b in (packed, zero_based):
        b.pop("labels"), b.pop("row")
    with torch.no_grad():
        reference = model(**padded).logits
        padding_free.apply(ON, model)
        assert (model(**packed).logits - reference).abs().max().item() <= LOGITS_ATOL
        assert (model(**zero_based).logits - reference).abs().max().item() > 100 * LOGITS_ATOL
        exact = padding_free.attention

        def one_sequence(module, query, key, value, mask, cu_seq_lens_q=None, max_length_q=None, **kwargs):
            whole = torch.tensor([0, query.shape[2]], dtype=torch.int32)  # every token sees every other
            return exact(module, query, key, value, mask, cu_seq_lens_q=whole, max_length_q=query.shape[2], **kwargs)

        from transformers import AttentionInterface

        AttentionInterface.register(padding_free.NAME, one_sequence)
        try:
            assert (model(**packed).logits - reference).abs().max().item() > 5 * LOGITS_ATOL
        finally:
            AttentionInterface.register(padding_free.NAME, exact)


def test_length_groups_minimise_the_attention_cost(monkeypatch):
    """The groups' cost (members x longest^2 + GROUP_OVERHEAD each) is the least over every split of the sequences
    sorted by length (checked by enumeration), and every sequence is in exactly one group."""
    import itertools
    import random

    def cost(groups, lengths):
        return sum(len(g) * max(lengths[i] for i in g) ** 2 + padding_free.GROUP_OVERHEAD for g in groups)

    rng = random.Random(0)
    for overhead in (0, 300, 16384):
        monkeypatch.setattr(padding_free, "GROUP_OVERHEAD", overhead)
        for _ in range(30):
            lengths = [rng.randint(1, 128) for _ in range(rng.randint(1, 8))]
            groups = padding_free.length_groups(lengths)
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
            best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths)
                       for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
            assert cost(groups, lengths) == best
    assert padding_free.length_groups([7, 7, 7]) == [[0, 1, 2]]  # equal lengths never split, whatever the cost


def test_collator_boundaries_positions_and_counts():
    features = [{"input_ids": [0, 5, 6, 2], "labels": 1, "sample_ids": 7},
                {"input_ids": [0, 9, 2], "labels": 0, "sample_ids": 3}]
    batch = padding_free.PackingCollator(2, "sample_ids")(features)
    assert batch["input_ids"].tolist() == [[0, 5, 6, 2, 0, 9, 2]]
    assert batch["position_ids"].tolist() == [[2, 3, 4, 5, 2, 3, 4]]  # RoBERTa: from pad_token_id + 1
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 4, 7]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_q"] == batch["max_length_k"] == 4
    assert batch["labels"].tolist() == [1, 0] and batch["sample_ids"] == [7, 3] and "attention_mask" not in batch
    tokens, computed = padding_free.token_counts(batch)
    assert float(tokens) == computed == 7
    tokens, computed = padding_free.token_counts({"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    assert float(tokens) == 3 and computed == 6


def test_rounded_rows_end_in_a_filler_sequence_the_head_never_sees():
    """--padding_free --pad_to_multiple_of: 1 to m filler tokens as one more sequence, the longest rounded up as a
    padded batch's; the re-padded sequence output has the padded batch's shape and values, the filler dropped."""
    features = [{"input_ids": [0, 5, 6, 2], "token_type_ids": [0, 0, 1, 1], "labels": 1},
                {"input_ids": [0, 9, 2], "token_type_ids": [0, 0, 0], "labels": 0}]
    rows = {m: padding_free.PackingCollator(2, "sample_ids", m, pad_id=1)([dict(f) for f in features]) for m in (4, 7)}
    assert rows[4]["input_ids"].tolist() == [[0, 5, 6, 2, 0, 9, 2, 1]]  # 7 tokens + 1 filler = 8
    assert rows[4]["token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0]]
    assert rows[4]["position_ids"].tolist() == [[2, 3, 4, 5, 2, 3, 4, 2]]
    assert rows[4]["cu_seq_lens_q"].tolist() == [0, 4, 7, 8] and rows[4]["max_length_q"] == 4
    assert rows[7]["input_ids"].shape == (1, 14) and rows[7]["cu_seq_lens_q"].tolist() == [0, 4, 7, 14]  # a whole m
    assert rows[7]["max_length_q"] == rows[7]["max_length_k"] == 7 and rows[7]["labels"].tolist() == [1, 0]
    tokens, computed = padding_free.token_counts(rows[7], tail=True)
    assert float(tokens) == 7 and computed == 14
    model, config = tiny("roberta")
    model.eval()
    padded, _, _ = batches(config, "roberta", padding_free.first_position(config))
    with torch.no_grad():
        reference = model.base_model(**padded).last_hidden_state  # (4, 13, 32)
        padding_free.apply(flags_on(8), model)
        _, packed, _ = batches(config, "roberta", padding_free.first_position(config), 8)
        got = model.base_model(**{k: v for k, v in packed.items() if k not in ("labels", "row")}).last_hidden_state
    assert got.shape == (4, 16, 32)  # the padded batch's 13 rounded up to 16, no row for the filler
    real = padded["attention_mask"].bool()
    assert (got[:, :13][real] - reference[real]).abs().max().item() <= LOGITS_ATOL
    assert got[:, :13][~real].abs().max().item() == 0 and got[:, 13:].abs().max().item() == 0


@pytest.mark.parametrize("arch", ["deberta-v2", "mpnet", "deberta"])
def test_encoders_without_an_exact_path_are_refused_at_start(arch):
    from transformers import AutoConfig

    cfg = types.SimpleNamespace(padding_free=True, model_name_or_path=f"my-{arch}", trust_remote_code=False)
    with pytest.raises(RecipeError, match=f"--padding_free supports .*; {arch} \\(my-{arch}\\)"):
        padding_free.check_model(cfg, AutoConfig.for_model(arch))
    modern = AutoConfig.for_model("modernbert", classifier_pooling="mean")
    with pytest.raises(RecipeError, match="classifier_pooling 'cls'"):
        padding_free.check_model(cfg, modern)


def test_flags_it_cannot_serve_are_one_line_errors(tmp_path):
    proc = run_recipe(tmp_path / "dp", "--padding_free", "--data_parallel", config=None, check=False)
    assert proc.returncode == 2 and "nn.DataParallel cannot split" in proc.stderr
    assert not (tmp_path / "dp" / "run_config.json").exists()
    cfg = types.SimpleNamespace(padding_free=True, data_parallel=False, pad_to_max_length=True,
                                attn_implementation="eager")
    problems = padding_free.flag_problems(cfg)
    assert len(problems) == 2 and "--pad_to_max_length" in problems[0] and "eager" in problems[1]


# 200 samples, 2 ranks x 8 x accumulation 2 = 32 a step: 6 full steps and a partial 7th (8 samples); every rank's
# sample ids recorded. Only the padding-free DDP run saves checkpoints (steps 3, 6 and 7): the one at step 3
# (mid-epoch) is resumed; the other runs, the resumed one included, save none (--checkpointing_steps is exempt from
# the resume contract).
RUN = ["--max_train_samples", "200", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
       "--record_ranks"]
CHECKPOINTED = ["--checkpointing_steps", "3"]
STRATEGY_ATOL = 5e-7  # float32 sums in another order (as tests/test_strategies.py's PARITY_ATOL)


@pytest.fixture(scope="module")
def runs(no_dropout_model, tmp_path_factory):
    """Dynamic padding on DDP, and padding-free on DDP: the references every other launch compares with."""
    root = tmp_path_factory.mktemp("padding_free")
    flags = ["--model_name_or_path", str(no_dropout_model), *RUN]
    run_recipe(root / "padded", *flags)
    run_recipe(root / "packed", *flags, *CHECKPOINTED, "--padding_free")
    return root, flags


def assert_same_training(ref, out, atol: float, multiple: int = 0):
    """`multiple`: --pad_to_multiple_of, each packed row rounded up by 1 to `multiple` filler positions."""
    ref_records, got_records = read_jsonl(ref / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert len(got_records) == len(ref_records) == 7 and got_records[-1]["samples"] == 8
    delta = max(abs(a - b) for a, b in zip(losses(ref), losses(out)))
    print(f"{out.name}: max |loss diff| vs {ref.name} = {delta:.2e}")
    assert delta <= atol
    assert [r["tokens"] for r in got_records] == [r["tokens"] for r in ref_records]
    if multiple:  # a step's micro-batches (2 here) each computed 1 to `multiple` filler positions, no padding
        micro = [-(-r["samples"] // 16) for r in got_records]  # one process, micro-batches of 16 samples
        assert all(r["padded_tokens"] % multiple == 0 for r in got_records)
        assert all(n <= r["padded_tokens"] - r["tokens"] <= n * multiple for r, n in zip(got_records, micro))
    else:
        assert all(r["padded_tokens"] == r["tokens"] for r in got_records)  # no position computed for padding
    ref_eval, got_eval = read_jsonl(ref / "eval.jsonl")[-1], read_jsonl(out / "eval.jsonl")[-1]
    assert got_eval["n_examples"] == ref_eval["n_examples"] == 101
    assert abs(got_eval["loss"] - ref_eval["loss"]) <= 10 * atol + 1e-7


def test_ddp_equals_dynamic_padding_and_resumes_exactly(runs, tmp_path):
    root, flags = runs
    padded, packed = root / "padded", root / "packed"
    assert_same_training(padded, packed, 1e-6)
    assert any(r["padded_tokens"] > r["tokens"] for r in read_jsonl(padded / "metrics.jsonl"))
    for r_pad, r_pack in zip(rank_records(padded), rank_records(packed)):
        assert r_pack["sample_ids"] == r_pad["sample_ids"]  # the same samples in every micro-batch
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(packed / "metrics.jsonl", resumed)
    run_recipe(resumed, *flags, "--padding_free", "--resume_from_checkpoint",
               str(packed / "checkpoints" / "step_3"))
    assert losses(resumed) == losses(packed)  # exact: the same arithmetic after the checkpoint
    assert read_jsonl(resumed / "eval.jsonl")[-1] == read_jsonl(packed / "eval.jsonl")[-1]
    run_config = json.loads((packed / "run_config.json").read_text())
    assert run_config["config"]["padding_free"] is True


@pytest.mark.parametrize("config", [None, "fsdp.yaml", "zero2.yaml", "zero3.yaml", "zero3_offload.yaml"])
def test_every_strategy_trains_the_dynamic_padding_losses(runs, tmp_path, config):
    root, flags = runs
    launch = fp32_launch_args(config, tmp_path) if config else []
    # one process: the same 32 samples a step, and each packed row rounded up to a multiple of 8
    one_process = [] if config else ["--per_device_train_batch_size", "16", "--pad_to_multiple_of", "8"]
    run_recipe(tmp_path / "run", *flags, *one_process, "--padding_free", config=config, launch_args=launch)
    assert_same_training(root / "padded", tmp_path / "run", STRATEGY_ATOL if config else 1e-6, 0 if config else 8)


def test_group_by_length_with_padding_free_trains_the_grouped_losses(runs, tmp_path):
    """--group_by_length --padding_free (allowed together), one process: the grouped micro-batches of dynamic padding,
    sample for sample, with their losses and eval, and no position computed for padding."""
    root, flags = runs
    grouped = [*flags, "--per_device_train_batch_size", "16", "--group_by_length"]
    run_recipe(tmp_path / "padded", *grouped, config=None)
    run_recipe(tmp_path / "packed", *grouped, "--padding_free", config=None)
    assert_same_training(tmp_path / "padded", tmp_path / "packed", 1e-6)
    [padded_rank], [packed_rank] = rank_records(tmp_path / "padded"), rank_records(tmp_path / "packed")
    assert packed_rank["sample_ids"] == padded_rank["sample_ids"]

    def padding_share(run):
        records = read_jsonl(run / "metrics.jsonl")
        return 1 - sum(r["tokens"] for r in records) / sum(r["padded_tokens"] for r in records)

    # grouping took effect: its padded batches of 16 hold less padding than the ungrouped reference's batches of 8
    shares = padding_share(tmp_path / "padded"), padding_share(root / "padded")
    print(f"padding share: grouped {shares[0]:.3f}, ungrouped {shares[1]:.3f}")
    assert shares[0] < shares[1] / 2


def test_predictions_in_input_order_and_equal_to_the_padded_ones(tiny_model, tmp_path):
    """One process, in-process: 37 rows of mixed lengths (one empty), padded, and packed with and without
    --group_by_length (longest first): every row once, in input order, the same probabilities."""
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from helpers import TINY_FLAGS
    from recipes import cls
    from recipes.inputs import data
    from recipes.outputs import predict

    texts = [("好" * (1 + (i * 7) % 40)) + f" {i}" for i in range(36)] + [""]
    path = tmp_path / "predict.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
    padding_free.apply(ON, model)  # padded batches keep their mask through the registered attention
    written = {}
    for name, flags in (("padded", []), ("packed", ["--padding_free"]),
                        ("packed_grouped", ["--padding_free", "--group_by_length"])):
        cfg = cls.parse_config([*TINY_FLAGS, "--predict_file", str(path), "--per_device_eval_batch_size", "8", *flags])
        predict_ds = data.prepare_predict(cfg, tokenizer, ["negative", "positive"])
        out = tmp_path / f"{name}.jsonl"
        assert predict.write_predictions(cfg, Accelerator(cpu=True), model, predict_ds, tokenizer,
                                         ["negative", "positive"], out) == len(texts)
        written[name] = read_jsonl(out)
    for name in ("packed", "packed_grouped"):
        assert [r["row"] for r in written[name]] == list(range(len(texts)))
        assert [r["prediction"] for r in written[name]] == [r["prediction"] for r in written["padded"]]
        for a, b in zip(written["padded"], written[name]):
            assert b["probabilities"] == pytest.approx(a["probabilities"], abs=LOGITS_ATOL)


@pytest.mark.parametrize("multiple", [0, 8])
def test_compiled_model_keeps_one_graph_over_new_lengths_and_counts(multiple, monkeypatch):
    """torch.compile with dynamic shapes (the recipe's --torch_compile plugin on dynamic batches): packed rows of other
    lengths and sequence counts (rounded up with a filler sequence: `multiple`) reuse the graph; the logits are the
    eager ones."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from recipes.model import compilation

    model, config = tiny("roberta")
    model.eval()
    padding_free.apply(flags_on(multiple), model)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for count in (4, 3, 5, 4):  # other sequence counts, lengths and longest lengths each call
        lengths = torch.randint(2, 30, (count,), generator=gen).tolist()
        features = [{"input_ids": torch.randint(3, 100, (n,), generator=gen).tolist()} for n in lengths]
        rows.append(padding_free.PackingCollator(padding_free.first_position(config), "sample_ids", multiple,
                                                 config.pad_token_id)(features))
        assert rows[-1]["input_ids"].shape[1] % (multiple or 1) == 0
    with torch.no_grad():
        eager = [model(**row).logits for row in rows]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        for row, expected in zip(rows, eager):
            compilation.mark_dynamic(row, (0, 1))
            got = compiled(**row).logits
            assert got.shape == expected.shape and (got - expected).abs().max().item() <= LOGITS_ATOL
    assert counters["stats"]["unique_graphs"] == 1


def test_lora_adapters_on_the_packed_model_give_the_padded_logits():
    """--use_peft wraps the model after --padding_free (recipes/cls.py build_model): PEFT's forward passes the
    boundaries and position ids on to the hooked model."""
    from peft import LoraConfig, get_peft_model

    model, config = tiny("roberta")
    padded, packed, _ = batches(config, "roberta", padding_free.first_position(config))
    packed.pop("labels"), packed.pop("row")
    padding_free.apply(ON, model)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")).eval()
    with torch.no_grad():
        for layer in wrapped.base_model.model.roberta.encoder.layer:  # non-zero adapters: B starts at zero
            torch.nn.init.normal_(layer.attention.self.query.lora_B["default"].weight)
        assert (wrapped(**packed).logits - wrapped(**padded).logits).abs().max().item() <= LOGITS_ATOL
