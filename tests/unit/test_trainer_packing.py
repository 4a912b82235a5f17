"""The packed layout (services/trainer/packing.py) on hand-made batches: which
positions each packed position may see, where each trained token's predictor sits."""
from __future__ import annotations

import torch

from services.trainer.packing import common_prefix, pack, plan_packs

PAD = 0


def _batch(rows: list[list[int]], trained: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask, and a target mask with ``trained[r]`` positions set."""
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), PAD)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    targets = torch.zeros((len(rows), length - 1))
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
        targets[r, trained[r]] = 1
    return ids, mask, targets


def test_common_prefix_stops_at_the_first_difference_and_the_shortest_row() -> None:
    ids, mask, _ = _batch([[5, 6, 7, 8], [5, 6, 9], [5, 6, 7]], [[], [], []])
    assert common_prefix(ids, mask.sum(dim=1)) == 2
    ids, mask, _ = _batch([[5, 6, 7], [5, 6, 7, 8]], [[], []])
    assert common_prefix(ids, mask.sum(dim=1)) == 3  # one row is all prefix
    ids, mask, _ = _batch([[1, 2], [3, 2]], [[], []])
    assert common_prefix(ids, mask.sum(dim=1)) == 0
    ids, mask, _ = _batch([[4, 5, 6]], [[]])
    assert common_prefix(ids, mask.sum(dim=1)) == 3


def test_layout_of_a_group_sharing_its_prompt() -> None:
    # Prompt [5, 6]; row 0 adds [7, 8], row 1 adds [9] (padded); trained tokens are
    # row 0's 7 and 8 (predicted from positions 1 and 2) and row 1's 9 (position 1).
    ids, mask, targets = _batch([[5, 6, 7, 8], [5, 6, 9]], [[1, 2], [1]])
    layout = pack(ids, mask, targets)
    assert layout.prefix == 2
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    seen = layout.attention[0, 0].int().tolist()
    assert seen == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # row 0's 7 sees the prompt and itself
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # row 1's 9 sees the prompt, never row 0
    ]
    # Position 1 (the prompt's last) predicts row 0's 7 and row 1's 9: one logit row, two targets.
    assert layout.keep.tolist() == [1, 2]
    entries = sorted(zip(layout.rows.tolist(), layout.cols.tolist(), layout.keep[layout.source].tolist(), layout.targets.tolist()))
    assert entries == [(0, 1, 1, 7), (0, 2, 2, 8), (1, 1, 1, 9)]


def test_trained_tokens_inside_the_shared_prefix_come_from_the_prefix() -> None:
    # The rows share a first turn [5, 6, 7] that is trained (position 1 predicts 7).
    ids, mask, targets = _batch([[5, 6, 7, 8], [5, 6, 7, 9]], [[1, 2], [1, 2]])
    layout = pack(ids, mask, targets)
    assert layout.prefix == 3
    packed = dict(zip(zip(layout.rows.tolist(), layout.cols.tolist()), layout.keep[layout.source].tolist()))
    assert packed == {(0, 1): 1, (1, 1): 1, (0, 2): 2, (1, 2): 2}
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9]]


def test_rows_with_nothing_in_common_are_packed_side_by_side() -> None:
    ids, mask, targets = _batch([[1, 2, 3], [4, 5]], [[0, 1], [0]])
    layout = pack(ids, mask, targets)
    assert layout.prefix == 0
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert not layout.attention[0, 0, 3, :3].any() and not layout.attention[0, 0, :3, 3:].any()
    assert layout.keep.tolist() == [0, 1, 3]


def test_packs_stay_within_the_row_and_position_bounds() -> None:
    prompt = [7] * 10
    rows = [prompt + [1, 2, 3], prompt + [4, 5], prompt + [6], [9] * 30, prompt + [8, 8]]
    ids, mask, _ = _batch(rows, [[] for _ in rows])
    lengths = mask.sum(dim=1)
    # Rows 0-2 share the prompt: 10 + 3 + 2 + 1 = 16 positions; row 3 is 30 on its own.
    assert plan_packs(ids, lengths, max_rows=8, max_positions=20) == [(0, 3), (3, 4), (4, 5)]
    assert plan_packs(ids, lengths, max_rows=2, max_positions=100) == [(0, 2), (2, 4), (4, 5)]
    assert plan_packs(ids, lengths, max_rows=8, max_positions=15) == [(0, 2), (2, 3), (3, 4), (4, 5)]
