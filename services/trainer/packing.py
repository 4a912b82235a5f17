"""Shared-prefix packing: the rows of a micro-batch as one sequence, their common
prefix computed once.

The samples of a GRPO group share their prompt (system prompt, tool descriptions, the
task), which is most of each sequence: with the built-in model's tool-use prompt, a
group of 8 samples of <= 64 new tokens is ~2,200 padded positions of which ~1,600
repeat the same prompt. Packing the rows as

    prefix | row 0's rest | row 1's rest | ...

with a block mask (each rest sees the prefix and, causally, itself) and each row's own
positions computes the same per-token log-probs as the padded batch, up to
floating-point summation order, from about a third of the positions and no padding.
The output layer runs only where a trained token is predicted. The backward pass sums
the rows' gradients through the one shared prefix, which is the same sum the padded
batch makes over its copies.

Pure layout logic over tensors; :func:`packed_logprobs` runs a Hugging Face causal LM
on it (one forward call, so DDP and FSDP see an ordinary forward).
"""
from __future__ import annotations

import dataclasses

import torch

#: Trained positions per chunk of the log-prob computation (chunk x vocabulary fp32 logits).
LOGPROB_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each row's positions sit in the packed sequence."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    attention: torch.Tensor  # [1, 1, N, N] bool, True: may attend
    keep: torch.Tensor  # [K] packed positions whose logits are needed (ascending)
    rows: torch.Tensor  # [E] batch row of each trained entry
    cols: torch.Tensor  # [E] its position in the row's [T-1] target axis
    source: torch.Tensor  # [E] index into ``keep`` of the position predicting it
    targets: torch.Tensor  # [E] the token it predicts
    prefix: int  # shared positions

    def to(self, device: torch.device) -> PackedLayout:
        """The same layout with every tensor on ``device`` (no copy where they are)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def common_prefix(input_ids: torch.Tensor, lengths: torch.Tensor) -> int:
    """Length of the longest token prefix every row shares (within each row's length)."""
    shortest = int(lengths.min())
    if input_ids.shape[0] == 1:
        return shortest
    same = (input_ids[:, :shortest] == input_ids[:1, :shortest]).all(dim=0)
    differs = torch.nonzero(~same)
    return int(differs[0]) if differs.numel() else shortest


def plan_packs(input_ids: torch.Tensor, lengths: torch.Tensor, max_rows: int, max_positions: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[start, stop)`` to pack together: at most ``max_rows``
    rows and ``max_positions`` packed positions each (a row longer than that alone).

    The bound matters because attention over a packed sequence is quadratic in its whole
    length, not in each row's: a few long rows are cheaper padded side by side.
    """
    ranges: list[tuple[int, int]] = []
    start, rows = 0, input_ids.shape[0]
    while start < rows:
        stop = start + 1
        while stop < rows and stop - start < max_rows:
            candidate = slice(start, stop + 1)
            prefix = common_prefix(input_ids[candidate], lengths[candidate])
            if prefix + int((lengths[candidate] - prefix).sum()) > max_positions:
                break
            stop += 1
        ranges.append((start, stop))
        start = stop
    return ranges


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor) -> PackedLayout:
    """The packed layout of a right-padded batch ([B, T] ids and mask, [B, T-1] targets),
    on the batch's device.

    Entries are the (row, position) pairs where ``target_mask`` is non-zero: only they
    get a log-prob. The layout is built on the CPU: it is a few small index tensors per
    row, and on a GPU each would be a kernel launch of its own.
    """
    return _layout(input_ids.cpu(), attention_mask.cpu(), target_mask.cpu()).to(input_ids.device)


def _layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor) -> PackedLayout:
    lengths = attention_mask.sum(dim=1)
    prefix = common_prefix(input_ids, lengths)
    pieces, positions, owners = [input_ids[0, :prefix]], [torch.arange(prefix)], [torch.full((prefix,), -1)]
    starts = []  # packed index of each row's first own position
    offset = prefix
    for row, n in enumerate(lengths.tolist()):
        starts.append(offset)
        pieces.append(input_ids[row, prefix:n])
        positions.append(torch.arange(prefix, n))
        owners.append(torch.full((n - prefix,), row))
        offset += n - prefix
    ids = torch.cat(pieces).unsqueeze(0)
    owner = torch.cat(owners)
    pos = torch.cat(positions)
    # Causal within each row and the prefix; a row's own positions also see the prefix.
    causal = pos.unsqueeze(1) >= pos.unsqueeze(0)
    visible = (owner.unsqueeze(0) == -1) | (owner.unsqueeze(0) == owner.unsqueeze(1))
    attention = (causal & visible).unsqueeze(0).unsqueeze(0)

    rows, cols = torch.nonzero(target_mask, as_tuple=True)
    starts_t = torch.tensor(starts, dtype=torch.long)
    # Position t of row r predicts token t + 1; t sits in the prefix or in r's own part.
    packed = torch.where(cols < prefix, cols, starts_t[rows] + (cols - prefix)) if rows.numel() else cols
    keep, source = torch.unique(packed, sorted=True, return_inverse=True)
    return PackedLayout(
        input_ids=ids, position_ids=pos.unsqueeze(0), attention=attention, keep=keep, rows=rows, cols=cols, source=source,
        targets=input_ids[rows, cols + 1], prefix=prefix,
    )


def _mask_for(layout: PackedLayout, attention: str) -> torch.Tensor:
    """The block mask as the attention kernel takes it: SDPA a boolean mask; the eager
    kernel adds its mask to the scores, so it needs 0 / a large negative number (a
    boolean there would add 1 and 0 and let every row see every other)."""
    if attention == "eager":
        return torch.zeros(layout.attention.shape, dtype=torch.float32, device=layout.attention.device).masked_fill_(~layout.attention, torch.finfo(torch.float32).min)
    return layout.attention


def packed_logprobs(model: torch.nn.Module, layout: PackedLayout, fill: torch.Tensor, attention: str = "sdpa", chunk: int = LOGPROB_CHUNK) -> torch.Tensor:
    """Per-token log-probs [B, T-1] of the trained entries from one forward pass of
    ``model`` (whose attention kernel is ``attention``: sdpa or eager) over the packed
    sequence; every other position holds ``fill`` (the behaviour log-probs, so an
    untrained position's ratio is exactly 1 and never overflows before its mask zeroes it)."""
    out = fill.detach().clone()
    inputs = {"input_ids": layout.input_ids, "attention_mask": _mask_for(layout, attention), "position_ids": layout.position_ids}
    if layout.keep.numel() == 0:
        # Nothing trained, but the forward and backward passes still run (data-parallel
        # ranks wait for every parameter's gradient): a zero that depends on the model.
        return out + 0.0 * model(**inputs, logits_to_keep=1).logits.sum()
    logits = model(**inputs, logits_to_keep=layout.keep).logits[0]
    values = []
    for start in range(0, layout.source.numel(), chunk):
        source = layout.source[start : start + chunk]
        # index_select, not logits[source]: rows sharing the prompt repeat its last position
        # in ``source``, and a tensor index's CPU backward adds repeats with atomics in thread
        # order (different bits from one run to the next: a replayed step must give the same);
        # index_select's adds them one index after the other.
        piece = logits.index_select(0, source).float()
        picked = piece.gather(-1, layout.targets[start : start + chunk].unsqueeze(-1)).squeeze(-1)
        values.append(picked - torch.logsumexp(piece, dim=-1))
    out[layout.rows, layout.cols] = torch.cat(values).to(out.dtype)
    return out
