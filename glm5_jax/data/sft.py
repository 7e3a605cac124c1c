"""SFT batches: rendered chats (token ids + per-token loss mask) packed into fixed-length rows with segment ids
and positions, through the same grain first-fit packer as pre-training. Conversations longer than a row
were already dropped and counted by `render_dataset(max_length=seq_len)`."""

from __future__ import annotations

import numpy as np

from glm5_jax.data.chat import RenderedChat
from glm5_jax.data.pretrain import DataError, _pad_rows


def sft_dataset(examples: list[RenderedChat], *, seq_len: int, batch_size: int, seed: int = 0,
                shuffle: bool = True, num_epochs: int | None = None):
    """A grain IterDataset of {tokens, segment_ids, positions, loss_mask} [batch_size, seq_len] batches."""
    if not examples:
        raise DataError("the SFT dataset is empty: every record was dropped or none was given")
    too_long = [i for i, ex in enumerate(examples) if len(ex) > seq_len]
    if too_long:
        raise DataError(f"{len(too_long)} rendered conversations exceed seq_len={seq_len} (first: #{too_long[0]}); "
                        "render with max_length=seq_len so they are dropped and counted")
    import grain

    items = [{"tokens": ex.ids.astype(np.int32), "loss_mask": ex.loss_mask.astype(np.int32)} for ex in examples]
    dataset = grain.MapDataset.source(items)
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    stream = dataset.repeat(num_epochs).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    packed = grain.experimental.FirstFitPackIterDataset(
        stream, length_struct={"tokens": seq_len, "loss_mask": seq_len}, num_packing_bins=batch_size, seed=seed,
        shuffle_bins=shuffle)

    def to_batch(row):
        return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"],
                "positions": row["tokens_positions"], "loss_mask": row["loss_mask"]}

    return packed.map(to_batch).batch(batch_size, drop_remainder=False).map(_pad_rows(batch_size))
