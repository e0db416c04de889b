"""The order of a sharded dataset's samples in an epoch: long runs of each shard for
every rank, random mixing in every global batch, the same on any number of workers.

A function of (seed, epoch, the shards' sample counts, the block size S, the global batch
G) alone, never of the world size:

    1. each shard is cut into blocks of S consecutive samples (its last one shorter);
    2. the blocks are permuted, seeded by (seed, epoch), and the samples inside each block
       shuffled: concatenated, that is P, the epoch's N samples;
    3. with L = N // G, P[:G*L] is cut into G streams of L samples, stream j being
       P[j*L:(j+1)*L], read forwards for even j and backwards for odd j;
    4. global batch i is position i of every stream: sample i of stream j at place j of
       the batch. The last N - G*L samples of P are dropped (a different few each epoch).

Flattened batch by batch, that is an ordinary epoch order (spotring.sampler.Order):
global batch i is its slice [i*G, (i+1)*G), and micro-step k of rank r its part k*W + r,
which is B consecutive streams. So a rank reads K contiguous runs of P (K = its
micro-steps per step), each its share plus at most a partial block at each end, and the
two streams that meet inside a block read it in the same steps (the backward streams
see to that), so a block is fetched once per epoch even by a small cache.

Mixing: the G samples of a batch sit L positions apart in P, so when S <= L they come
from G different blocks, drawn at random from all blocks: from random shards, however
the shards were written (class-sorted ones too). Near the ends of the epoch two
neighbouring streams meet (the first and last S/2 steps), where a pair may share a
block; with S much smaller than L that is a small part of the epoch (docs/streaming.md
gives the measured figure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spotring.sampler import seeded_generator


def block_starts(counts: Sequence[int], block_samples: int) -> torch.Tensor:
    """The first global sample index of every block, shard after shard, and N at the end:
    block b holds samples [starts[b], starts[b+1])."""
    starts, base = [], 0
    for count in counts:
        starts.extend(range(base, base + count, block_samples))
        base += count
    return torch.tensor([*starts, base], dtype=torch.long)


@dataclass(frozen=True)
class Layout:
    """One epoch's P and its streams, and what a reader asks of them.

    permutation: P, the N sample indices in the epoch's block order.
    following: for each sample, the block its stream reads after the sample's block: the
        next block of P for a forward stream, the one before for a backward stream; -1 at
        the stream's end and in the dropped tail.
    stream_length: L = N // G; places from G*L on are the dropped tail.
    """

    permutation: torch.Tensor
    following: torch.Tensor
    stream_length: int
    global_batch: int

    def epoch_order(self) -> torch.Tensor:
        """P read stream by stream, batch by batch (see the module docstring), then the
        dropped tail: a permutation of the N samples whose slice i of G is batch i."""
        g, length = self.global_batch, self.stream_length
        streams = self.permutation[:g * length].view(g, length).clone()
        streams[1::2] = streams[1::2].flip(1)
        return torch.cat([streams.t().reshape(-1), self.permutation[g * length:]])


def layout(starts: torch.Tensor, seed: int, epoch: int, global_batch: int) -> Layout:
    """Epoch ``epoch``'s layout of the blocks ``starts`` (block_starts) for global batch
    ``global_batch``, seeded by (seed, epoch)."""
    n, blocks = int(starts[-1]), len(starts) - 1
    sizes = starts[1:] - starts[:-1]
    block_of = torch.repeat_interleave(torch.arange(blocks), sizes)
    g = seeded_generator(seed, epoch)
    shuffled = torch.randperm(blocks, generator=g)  # block at each place of the block order
    rank = torch.empty(blocks, dtype=torch.long)
    rank[shuffled] = torch.arange(blocks)
    # Sorting by (the block's place, a random key) groups the blocks in their permuted
    # order and shuffles the samples inside each one.
    key = rank[block_of].to(torch.float64) + torch.rand(n, generator=g, dtype=torch.float64)
    permutation = torch.argsort(key)
    # Each block's places in P, and for each place the place its stream reads next
    # outside the place's block, where that is still in the same stream.
    ends = torch.cumsum(sizes[shuffled], 0)
    first, end = torch.empty(blocks, dtype=torch.long), torch.empty(blocks, dtype=torch.long)
    first[shuffled], end[shuffled] = ends - sizes[shuffled], ends
    length = n // global_batch
    place = torch.arange(n)
    place_block = block_of[permutation]
    stream = place // length if length else torch.full((n,), global_batch)
    beyond = torch.where(stream % 2 == 0, end[place_block], first[place_block] - 1)
    inside = (stream < global_batch) & (beyond >= stream * length) & (
        beyond < (stream + 1) * length)
    following = torch.empty(n, dtype=torch.long)
    following[permutation] = torch.where(inside, place_block[beyond.clamp(0, n - 1)], -1)
    return Layout(permutation, following, length, global_batch)
