"""--padding_free: every micro-batch runs without padding positions, exactly (TRL's name for the same idea).

A padded batch of n sequences computes n x L positions (L its longest); the real tokens are R = sum of the lengths.
Here the collator concatenates the n sequences into one row of R tokens and passes their boundaries; the model then
runs its embeddings, every linear layer and the feed-forward on the R real positions only, and attention keeps each
sequence to itself:
- collator side (`PackingCollator`): input_ids (1, R), per-sequence position ids counted as the padded model counts
  them (RoBERTa's family from pad_token_id + 1, the others from 0), token type ids for pairs, one label per sequence,
  and the boundaries transformers' attention interface (5.23) reads: `cu_seq_lens_q/k` (int32, n + 1 offsets) and
  `max_length_q/k` (the longest sequence). No attention mask: the boundaries are the mask.
- model side (`apply`): attention through `padding_free_sdpa`, registered in transformers' AttentionInterface: the
  packed queries, keys and values are re-padded per length group (the sequences sorted by length, split where one
  more SDPA call costs less than the padding it saves: `length_groups`) and go through torch's
  scaled_dot_product_attention with a key mask, then back to the R positions. Attention then costs about the sum of
  the squared lengths, not n x L^2; under torch.compile a micro-batch is one group (n x L^2, one graph for every
  length). On CUDA in fp16/bf16 without attention dropout (eval, or a model whose attention dropout is 0), torch's
  varlen flash kernel takes the packed row and its boundaries as they are. On CUDA with flash-attn installed,
  `--attn_implementation flash_attention_2` takes the boundaries directly (its varlen kernels, with dropout). One
  block-diagonal mask over the packed row would also be exact, but costs R x R per head: about twice the padded
  attention on the default data, so it is not used.
  The sequence output is re-padded to (n, L, hidden) where the encoder hands it to the pooler or head (a forward hook
  on that module, which gets the boundaries with its call): each head pools its own sequence's first token, as in
  the padded model.
- with --pad_to_multiple_of m, each packed row is rounded up: a tail of 1 to m filler tokens, which the boundaries
  make a sequence of its own (attention stays defined on every position, so no uninitialised kernel output reaches a
  gradient) and the re-pad drops before the head; the longest length is rounded up as the padded batch's is. On a
  GPU this bounds the shapes the linear layers see: a packed row of R tokens has a new R nearly every step, and a
  shape run for the first time costs host time (cuBLAS heuristics, kernel choice; docs/speed.md measures it).
Exact: per sequence, the same positions, token types, attention and pooling as the padded model; the logits agree
within float32 rounding (tests/test_padding_free.py states the bound). Dropout draws other random numbers, so
losses with dropout agree in distribution only.

Encoders whose attention goes through transformers' interface and whose position ids and boundaries reach it
(checked for BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT, ELECTRA, ALBERT, ModernBERT with `cls` pooling) are
accepted; any other is refused at start-up in one line.
"""
from __future__ import annotations

import inspect
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F

from recipes import RecipeError, first_line
from recipes.model import decoders

NAME = "padding_free_sdpa"  # the attention implementation registered in transformers' AttentionInterface
# model_type -> the module whose output is the sequence output the pooler or head reads (a path under base_model;
# "": the base model itself, which has no pooler in these sequence classifiers). Each receives the boundaries.
SEQUENCE_OUTPUT = {"bert": "encoder", "albert": "encoder", "roberta": "", "xlm-roberta": "", "camembert": "",
                   "electra": "", "distilbert": "", "modernbert": ""}
# Models whose position ids start after the padding index (RoBERTa's create_position_ids_from_input_ids):
# pad_token_id + 1 of the max_position_embeddings slots are never used by a token (514 - 2 = 512 for roberta-base).
OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text", "xmod",
                    "roberta-prelayernorm"}
SEQUENCE_KEYS = ("input_ids", "token_type_ids")  # per token; every other feature is one value per sequence


def check_model(cfg, config) -> None:
    """Start-up: --padding_free on an encoder it is exact for, without flags it cannot serve."""
    if not cfg.padding_free:
        return
    if decoders.is_decoder_config(config, cfg.trust_remote_code):
        if getattr(config.get_text_config(), "attn_logit_softcapping", None):
            raise RecipeError(f"--padding_free: {config.model_type} caps its attention scores "
                              "(attn_logit_softcapping), which SDPA cannot: drop --padding_free")
        return
    if config.model_type not in SEQUENCE_OUTPUT:
        raise RecipeError(f"--padding_free supports {', '.join(sorted(SEQUENCE_OUTPUT))} and decoder classifiers; "
                          f"{config.model_type} "
                          f"({cfg.model_name_or_path}) does not route attention through transformers' attention "
                          f"interface with sequence boundaries: drop --padding_free")
    if config.model_type == "modernbert" and getattr(config, "classifier_pooling", "cls") != "cls":
        raise RecipeError("--padding_free with ModernBERT needs classifier_pooling 'cls' (the mean pooling reads "
                          "the padded attention mask): drop --padding_free")


def flag_problems(cfg) -> list[str]:
    problems = []
    if cfg.padding_free and cfg.data_parallel:
        problems.append("--padding_free packs a micro-batch into one row, which nn.DataParallel cannot split over "
                        "its replicas: use a DDP launch config instead of --data_parallel")
    if cfg.padding_free and cfg.pad_to_max_length:
        problems.append("--padding_free and --pad_to_max_length ask for opposite batches: choose one")
    if cfg.padding_free and cfg.attn_implementation not in (None, "sdpa", "flash_attention_2", "flash_attention_3"):
        problems.append(f"--padding_free runs attention per sequence with sdpa or flash_attention_2/3, not "
                        f"--attn_implementation {cfg.attn_implementation}")
    return problems


def position_start(cfg) -> int:
    """The first position id of a sequence, as the model counts them when it is given none."""
    from transformers import AutoConfig

    # source.loading_kwargs' three flags, read here: source imports this module
    return first_position(AutoConfig.from_pretrained(cfg.model_name_or_path, revision=cfg.revision,
                                                     cache_dir=cfg.cache_dir, trust_remote_code=cfg.trust_remote_code))


def first_position(config) -> int:
    """The position id a model gives a sequence's first token: pad_token_id + 1 for OFFSET_POSITIONS, else 0."""
    return (config.pad_token_id or 0) + 1 if config.model_type in OFFSET_POSITIONS else 0


def row_multiple(cfg) -> int:
    """--pad_to_multiple_of with --padding_free: the multiple each packed row's length is rounded up to (0: none)."""
    multiple = cfg.pad_to_multiple_of or 1
    return multiple if cfg.padding_free and multiple > 1 else 0


class PackingCollator:
    """One packed row per micro-batch: the sequences end to end, their boundaries, one label (and row index) each;
    with `multiple`, a tail of 1 to `multiple` filler tokens (`pad_id`, token type 0) as one more sequence rounds the
    row's length up to a multiple of it (always present, so that the re-pad knows to drop it without reading a
    length from the device), and the longest length is rounded up as a padded batch's is.

    Example indices, when the examples carry them, travel as a plain list (as data.Collator's)."""

    def __init__(self, start: int, ids_key: str, multiple: int = 0, pad_id: int = 0):
        self.start, self.ids_key, self.multiple = start, ids_key, multiple
        self.fill = {"input_ids": pad_id, "token_type_ids": 0}

    def __call__(self, features):
        ids = [f.pop(self.ids_key) for f in features] if self.ids_key in features[0] else None
        lengths = [len(f["input_ids"]) for f in features]
        longest, total, tail = max(lengths), sum(lengths), 0
        if self.multiple:
            tail = (total // self.multiple + 1) * self.multiple - total  # 1 to multiple
            longest = -(-longest // self.multiple) * self.multiple  # >= tail
        batch = {key: torch.tensor([t for f in features for t in f[key]] + [self.fill[key]] * tail)[None]
                 for key in SEQUENCE_KEYS if key in features[0]}
        # the tail's positions run from the first one too (below the padded batch's rounded length: a valid id)
        batch["position_ids"] = torch.cat([torch.arange(self.start, self.start + n)
                                           for n in lengths + ([tail] if tail else [])])[None]
        bounds = torch.tensor([0, *accumulate(lengths)] + ([total + tail] if tail else []), dtype=torch.int32)
        batch.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds.clone(), max_length_q=longest, max_length_k=longest)
        for key in features[0]:
            if key not in SEQUENCE_KEYS and key != "attention_mask":
                batch[key] = torch.tensor([f[key] for f in features])
        if ids is not None:
            batch[self.ids_key] = ids
        return batch


def token_counts(batch, tail: bool = False) -> tuple[torch.Tensor, int]:
    """(real tokens, positions the linear layers compute) of a micro-batch, padded or packed (`tail`: packed rows end
    in PackingCollator's filler sequence)."""
    if "cu_seq_lens_q" in batch:
        n = batch["input_ids"].numel()
        if tail:  # the real tokens end where the filler sequence starts: read on the device, no sync
            return batch["cu_seq_lens_q"][-2].float(), n
        return torch.full((), n, dtype=torch.float32, device=batch["input_ids"].device), n
    mask = batch["attention_mask"]
    return mask.sum().float(), mask.numel()


def _slots(bounds: torch.Tensor, longest: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For n sequences re-padded to `longest`: each packed token's slot in the n x longest grid (its sequence x
    longest + its offset), and which slots hold a token (n, longest)."""
    token = torch.arange(total, device=bounds.device)
    sequence = torch.searchsorted(bounds[1:], token.to(bounds.dtype), right=True)
    slot = sequence * longest + token - bounds[sequence].long()
    offsets = torch.arange(longest, device=bounds.device)
    return slot, offsets < (bounds[1:] - bounds[:-1]).long()[:, None]


def _padded(packed: torch.Tensor, slot: torch.Tensor, n: int, longest: int) -> torch.Tensor:
    """(R, ...) -> (n, longest, ...), zeros where no token. A scatter to distinct slots: its backward is a gather.
    (Gathering by an (n, longest) index instead has a backward that accumulates into repeated indices, which was
    2.6x slower per call on CPU here.)"""
    grid = packed.new_zeros(n * longest, *packed.shape[1:]).index_put((slot,), packed)
    return grid.view(n, longest, *packed.shape[1:])


# One more attention call costs about as much as this many attention scores per head (a call's overhead over a
# score's cost on CPU, torch 2.13: about 7,000), counted twice, as the backward repeats the call overhead.
# Re-padding every sequence to the micro-batch's longest costs n x L^2 scores (the padded model's attention); one
# call per sequence costs n calls; the groups below sit between.
GROUP_OVERHEAD = 16384


def length_groups(lengths: list) -> list:
    """The sequences (indices into `lengths`) split into groups that are each re-padded to their own longest: the
    split of the sequences sorted by length that minimises sum over groups of (members x longest^2 + one call's
    cost, GROUP_OVERHEAD). Exact dynamic programming over the distinct lengths (at most n of them)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    # cut points only between different lengths: a group never splits sequences of the same length
    starts = [i for i in range(len(order)) if i == 0 or lengths[order[i]] != lengths[order[i - 1]]] + [len(order)]
    best, cut = [0.0] + [float("inf")] * (len(starts) - 1), [0] * len(starts)
    for b in range(1, len(starts)):
        for a in range(b):
            cost = best[a] + (starts[b] - starts[a]) * lengths[order[starts[a]]] ** 2 + GROUP_OVERHEAD
            if cost < best[b]:
                best[b], cut[b] = cost, a
    groups, b = [], len(starts) - 1
    while b:
        groups.append(order[starts[cut[b]]:starts[b]])
        b = cut[b]
    return groups[::-1]


class _Plan:
    """Where each packed token goes in the grids of its micro-batch's length groups: `slot` (R,) into the groups'
    grids laid end to end (`rows` in all); `groups`: (first row, sequences, longest, which slots hold a token
    (sequences, longest)) each, made once for every layer."""

    def __init__(self, bounds: torch.Tensor, longest, total: int):
        if torch.compiler.is_compiling():  # one group of static structure: lengths change every step, graphs do not
            self.slot, real = _slots(bounds, longest, total)
            n = bounds.shape[0] - 1
            self.groups, self.rows = [(0, n, longest, real)], n * longest
            return
        lengths = (bounds[1:] - bounds[:-1]).tolist()  # eager: the lengths on the host (one sync per forward)
        base, self.groups, row = [0] * len(lengths), [], 0
        for members in length_groups(lengths):
            top = lengths[members[0]]
            for rank, i in enumerate(members):
                base[i] = row + rank * top
            own = torch.tensor([lengths[i] for i in members], device=bounds.device)
            self.groups.append((row, len(members), top, torch.arange(top, device=bounds.device) < own[:, None]))
            row += len(members) * top
        self.rows = row
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=bounds.device),
                                           (bounds[1:] - bounds[:-1]).long(), output_size=total)
        self.slot = (torch.tensor(base, device=bounds.device)[sequence] + torch.arange(total, device=bounds.device)
                     - bounds[:-1].long()[sequence])


def _varlen_kernel():
    """torch's own varlen flash attention (torch.nn.attention.varlen.varlen_attn, CUDA, fp16/bf16, no dropout
    argument; in torch 2.13, not in every earlier torch), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # torch 2.9's first version took no scale (and had is_causal): not used there
    return varlen_attn if "scale" in inspect.signature(varlen_attn).parameters else None


# Used for a packed row on CUDA in fp16/bf16 without attention dropout. Looked up on first use, not at import: in
# torch 2.13 importing torch.nn.attention.varlen imports torch._dynamo, which `import recipes.cls` need not pay.
_VARLEN = ...  # not looked up yet


def _varlen():
    global _VARLEN
    if _VARLEN is ...:
        _VARLEN = _varlen_kernel()
    return _VARLEN


def _takes_varlen(query, dropout: float, sliding_window) -> bool:
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0
            and sliding_window is None and _varlen() is not None)
_LAST_PLAN: list = [None, None]  # (boundaries, plan) of the forward pass running now: every layer reuses it


def _plan(bounds: torch.Tensor, longest, total: int) -> _Plan:
    """The plan of these boundaries, made once per forward pass in eager mode (the same tensor reaches every layer);
    under torch.compile it is traced into the graph instead."""
    if torch.compiler.is_compiling():
        return _Plan(bounds, longest, total)
    if _LAST_PLAN[0] is not bounds:
        _LAST_PLAN[:] = [bounds, _Plan(bounds, longest, total)]
    return _LAST_PLAN[1]


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface (5.23): query/key/value (batch, heads, positions, head size) in, the output
    (batch, positions, heads, head size) out; the keywords as transformers passes them (dropout, scaling,
    sliding_window, the packed row's cu_seq_lens_q and max_length_q). A packed row (boundaries given) runs per length
    group: its sequences re-padded to the group's longest, one SDPA call with a key mask per group. A padded batch (the
    auto micro-batch probe's, a user's own call) runs as `sdpa`."""
    dropout, scaling = kwargs.pop("dropout", 0.0), kwargs.pop("scaling", None)
    sliding_window = kwargs.pop("sliding_window", None)
    cu_seq_lens_q, max_length_q = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("max_length_q", None)
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise RecipeError(f"--padding_free: {type(module).__name__} passes score capping or sinks to its attention, "
                          "which SDPA cannot run: drop --padding_free")
    if not torch.compiler.is_compiling():  # a compiled graph would guard on the count and recompile at each call
        decoders.PACKED_CALLS[0] += 1  # a decoder checks that every layer's attention came here
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: each key-value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    causal = getattr(module, "is_causal", False)  # a decoder: each token sees its own sequence up to itself
    if not causal and _takes_varlen(query, dropout, sliding_window):  # the packed row as it is: no re-pad, no sync
        out = _varlen()(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seq_lens_q,
                      cu_seq_lens_q, max_length_q, max_length_q, scale=scaling)
        return out.unsqueeze(0), None  # (1, R, heads, d)
    plan = _plan(cu_seq_lens_q, max_length_q, query.shape[2])
    grouped = _ToGroups.apply(plan, query, key, value)  # (q, k, v) of the first group, then of the next, ...
    outs = []
    for g, (first, n, longest, real) in enumerate(plan.groups):
        allowed = real[:, None, None, :]  # keys of the query's own sequence
        offsets = torch.arange(longest, device=query.device)
        if causal:
            allowed = allowed & (offsets[:, None] >= offsets[None, :])
        if sliding_window is not None:  # ModernBERT's local layers (5.23 passes half the window + 1), Mistral's
            allowed = allowed & ((offsets[:, None] - offsets[None, :]).abs() < sliding_window)
        outs.append(F.scaled_dot_product_attention(*grouped[3 * g:3 * g + 3], attn_mask=allowed, dropout_p=dropout,
                                                   scale=scaling))  # (n, heads, longest, d)
    return _FromGroups.apply(plan, *outs), None  # (1, R, heads, d)


def _group_views(grid: torch.Tensor, first: int, n: int, longest: int) -> tuple:
    """A length group's (n, heads, longest, d) views of a (..., rows, heads, d) grid (its rows first..first + n x
    longest), one per leading index (query, key and value) or one."""
    views = grid[..., first:first + n * longest, :, :].unflatten(-3, (n, longest)).transpose(-3, -2)
    return tuple(views) if grid.dim() == 4 else (views,)


# The re-pad and its way back, written as two autograd Functions. Built from autograd's own ops (a select, an
# index_put into a zero grid and a slice per group for each of query, key and value; a reshape, a cat and an
# index_select on the way back), backward allocates and fills a zero grid for every select and slice (torch 2.13).
# Here forward and backward move every value once, through one grid laid out as the packed row is (position, head,
# d). Measured on the tiny model on CPU, 2 threads, with dropout: 1.023 +- 0.021 times as fast per micro-batch
# (forward + backward, 12 alternating rounds in one process; docs/speed.md).
class _ToGroups(torch.autograd.Function):
    """(query, key, value), each (1, heads, R, d) -> per length group its (n, heads, longest, d) query, key and
    value, zeros where no token: views of one (3, rows, heads, d) grid. Backward: the groups' gradients into one
    grid and back to the R positions in one gather (a slot without a token is never read)."""

    @staticmethod
    def forward(ctx, plan, query, key, value):
        grid = query.new_zeros(3, plan.rows, query.shape[1], query.shape[3])
        for i, x in enumerate((query, key, value)):
            grid[i].index_copy_(0, plan.slot, x[0].transpose(0, 1))
        ctx.plan = plan
        return tuple(v for first, n, longest, _ in plan.groups for v in _group_views(grid, first, n, longest))

    @staticmethod
    def backward(ctx, *grads):
        plan, (_, heads, _, d) = ctx.plan, grads[0].shape
        grid = grads[0].new_empty(3, plan.rows, heads, d)
        for g, (first, n, longest, _) in enumerate(plan.groups):
            for view, grad in zip(_group_views(grid, first, n, longest), grads[3 * g:3 * g + 3]):
                view.copy_(grad)
        packed = grid.index_select(1, plan.slot).transpose(2, 1)  # (3, heads, R, d)
        return None, packed[0][None], packed[1][None], packed[2][None]


class _FromGroups(torch.autograd.Function):
    """Each length group's attention output (n, heads, longest, d) -> (1, R, heads, d), the packed row's order.
    Backward: the gradient scattered into a zero grid (slots without a token get none) and handed to each group as a
    view."""

    @staticmethod
    def forward(ctx, plan, *outs):
        grid = outs[0].new_empty(plan.rows, outs[0].shape[1], outs[0].shape[3])  # every row gets written
        for (first, n, longest, _), out in zip(plan.groups, outs):
            _group_views(grid, first, n, longest)[0].copy_(out)
        ctx.plan = plan
        # back to the packed row by each token's slot: a gather of known size R (selecting by a mask would give
        # torch.compile a data-dependent shape, a graph break in every layer)
        return grid.index_select(0, plan.slot)[None]

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        grid = grad.new_zeros(plan.rows, *grad.shape[2:]).index_copy_(0, plan.slot, grad[0])
        return None, *(_group_views(grid, first, n, longest)[0] for first, n, longest, _ in plan.groups)


def repad(module, args, kwargs, output, tail: bool = False):
    """A forward hook (with its module's keyword arguments) on the module SEQUENCE_OUTPUT names: a packed row's
    sequence output (1, R, hidden) re-padded to (n, L, hidden), zeros where a sequence has no token; `tail`: the
    row's last sequence is PackingCollator's filler, dropped. The boundaries come with the call, not from a stash on
    an object: torch.compile would guard on a stored length (one graph per longest length)."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        return output
    hidden, longest = output[0], kwargs["max_length_q"]
    slot, _ = _slots(bounds, longest, hidden.shape[1])
    grid = _padded(hidden[0], slot, bounds.shape[0] - 1, longest)
    output["last_hidden_state"] = grid[:-1] if tail else grid
    return output


def apply(cfg, model):
    """--padding_free: the model attends per sequence and hands its head one re-padded row per sequence."""
    if not cfg.padding_free:
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    # A padded batch (no boundaries) keeps its padding mask: transformers 5.23 builds no mask at all for an
    # attention name that has no mask function (masking_utils._preprocess_mask_arguments), so sdpa's is registered.
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if cfg.attn_implementation not in ("flash_attention_2", "flash_attention_3"):
        try:
            model.set_attn_implementation(NAME)
        except ValueError as err:  # transformers 5.23: a model that runs no SDPA-like attention (gpt-oss's sinks)
            raise RecipeError(f"--padding_free: {first_line(err)}; drop --padding_free") from None
    if model.config._attn_implementation not in (NAME, "flash_attention_2", "flash_attention_3"):
        raise RecipeError(f"--padding_free: {type(model).__name__} kept attention "
                          f"'{model.config._attn_implementation}'; drop --padding_free")
    if decoders.is_decoder_classifier(model):  # it pools each sequence's last token from the boundaries itself
        model.packed_tail = bool(row_multiple(cfg))  # the boundaries of a rounded-up row end in the filler's
        return model
    module = model.base_model.get_submodule(SEQUENCE_OUTPUT[model.config.model_type])
    module.register_forward_hook(partial(repad, tail=bool(row_multiple(cfg))), with_kwargs=True)
    return model
