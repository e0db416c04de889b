"""spotring's world-size-invariant order through torch's DataLoader: global batch i is the
same samples on any number of workers and accumulation, a mid-epoch position resumes on
another world size, and the trainer's in-memory batches are the same order."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from spotring.exits import ConfigError
from spotring.global_batch import split_global_batch
from spotring.loader import DataLoader
from spotring.sampler import GlobalBatchSampler, epoch_order
from spotring.trainer.data import Batches
from spotring.trainer.datasets import Dataset, Split

N, G, SEED = 1000, 24, 7
STEPS = N // G  # 41 global batches an epoch; the last 16 samples are dropped
# Sample i is an 8x8 image filled with i % 256 and labelled i: a batch tells its samples.
IMAGES = (torch.arange(N) % 256).to(torch.uint8).view(N, 1, 1, 1).expand(N, 1, 8, 8)
DATA = TensorDataset(IMAGES, torch.arange(N))


def expected(epoch: int) -> list[list[int]]:
    """The invariant itself: global batch i is slice i of the epoch's permutation."""
    order = epoch_order(N, SEED, epoch)
    return [order[i * G:(i + 1) * G].tolist() for i in range(STEPS)]


def loaders(world_size: int, batch_size: int | None = None, **kwargs) -> list[DataLoader]:
    """The loaders of all ranks of one simulated run."""
    return [DataLoader(DATA, G, batch_size=batch_size, seed=SEED, rank=r,
                       world_size=world_size, **kwargs) for r in range(world_size)]


def gathered(ranks: list[DataLoader], steps: int | None = None) -> list[list[int]]:
    """Each global batch's samples gathered over all ranks in the order of its slices
    (micro-step k of rank r is slice k*W + r), the ranks stepping in lockstep as the
    workers of one run do; ``steps`` global batches, or to the epoch's end."""
    done, current = [], []
    for per_rank in zip(*ranks, strict=True):
        current += [sample for _, y in per_rank for sample in y.tolist()]
        if ranks[0].is_step_boundary:
            done.append(current)
            current = []
            if len(done) == steps:
                break
    assert current == []  # the epoch ends on a step boundary
    return done


SPLITS = [(1, None), (2, None), (3, None), (4, None), (2, 6), (3, 2), (4, 3), (1, 5)]


def test_global_batches_are_the_same_samples_for_1_to_4_workers_and_any_accumulation():
    for world_size, batch_size in SPLITS:
        ranks = loaders(world_size, batch_size)
        assert gathered(ranks) == expected(0), (world_size, batch_size)
        for loader in ranks:
            loader.set_epoch(3)
        assert gathered(ranks) == expected(3), (world_size, batch_size)
    # (1, 5): 24 samples on one worker, at most 5 per micro-step: 6 micro-steps of 4
    assert (ranks[0].batch_size, ranks[0].accumulation) == (4, 6)


def test_worker_processes_prefetching_ahead_do_not_move_the_position():
    # Rank 1 of 3, 2 samples per micro-step, 4 micro-steps: slice k*3 + 1 of each batch.
    loader = DataLoader(DATA, G, batch_size=2, seed=SEED, rank=1, world_size=3,
                        num_workers=2, persistent_workers=True, prefetch_factor=4)
    mine = [[batch[(k * 3 + 1) * 2:(k * 3 + 2) * 2] for k in range(4)] for batch in expected(0)]
    micro = list(itertools.islice(loader, 5 * 4))  # the workers have fetched up to 8 more
    assert [y.tolist() for _, y in micro] == sum(mine[:5], [])
    assert loader.state_dict()["offset"] == 5 * G and len(loader) == (STEPS - 5) * 4
    assert [y.tolist() for _, y in loader] == sum(mine[5:], [])  # the rest, not a sample lost
    assert len(loader) == 0 and list(loader) == []
    loader.set_epoch(1)  # the persistent workers start over in the new epoch
    _, y = next(iter(loader))
    assert y.tolist() == expected(1)[0][2:4]


def test_an_epoch_is_disjoint_and_drops_a_tail_shorter_than_the_global_batch():
    ranks = loaders(3)
    assert [len(loader) for loader in ranks] == [STEPS] * 3 == [ranks[0].steps_per_epoch] * 3
    seen = sum(gathered(ranks), [])
    assert len(seen) == len(set(seen)) == STEPS * G == 984
    dropped = set(range(N)) - set(seen)
    assert dropped == set(epoch_order(N, SEED, 0)[984:].tolist()) and len(dropped) == 16
    # the epoch iterated to its end: the loaders stand there until the next set_epoch
    assert [len(loader) for loader in ranks] == [0] * 3
    assert ranks[0].state_dict() == {"epoch": 0, "offset": 984, "seed": SEED, "global_batch": G}
    assert list(ranks[0]) == []


@pytest.mark.parametrize("world_size, batch_size, accumulation", [(1, 12, 2), (4, 3, 2)])
def test_a_position_saved_mid_epoch_on_2_workers_continues_on_another_number(
        world_size, batch_size, accumulation):
    two = loaders(2)
    for loader in two:
        loader.set_epoch(1)
    whole = gathered(two)
    for loader in two:
        loader.set_epoch(0)  # another epoch: from its start
        loader.set_epoch(1)
    assert gathered(two, steps=5) == whole[:5]
    state = two[0].state_dict()
    assert state == {"epoch": 1, "offset": 5 * G, "seed": SEED, "global_batch": G}
    assert two[1].state_dict() == state

    resumed = loaders(world_size, batch_size)
    assert resumed[0].accumulation == accumulation  # the global batch is kept
    for loader in resumed:
        loader.load_state_dict(state)
        loader.set_epoch(1)  # as a resumed run's epoch loop does: the offset stays
    assert gathered(resumed) == whole[5:]


def test_set_epoch_keeps_the_position_in_the_same_epoch_and_starts_another_at_0():
    loader = DataLoader(DATA, G, seed=SEED, rank=0, world_size=1)
    assert next(iter(loader))[1].tolist() == expected(0)[0]
    loader.set_epoch(0)
    assert (loader.epoch, loader.state_dict()["offset"]) == (0, G)
    assert next(iter(loader))[1].tolist() == expected(0)[1]
    loader.set_epoch(2)
    assert (loader.epoch, loader.state_dict()["offset"], len(loader)) == (2, 0, STEPS)
    assert next(iter(loader))[1].tolist() == expected(2)[0] != expected(0)[0]
    loader.set_epoch(0)
    assert next(iter(loader))[1].tolist() == expected(0)[0]  # reproducible


def test_a_first_step_taken_again_from_the_end_of_the_epoch_before_stays_in_its_epoch():
    """A job in place takes a dropped step again from the position it kept at the boundary
    before it (load_state_dict mid-iteration): for an epoch's first step, the end of the
    epoch before. The iteration goes on in its own epoch, and no epoch is skipped."""
    loader = DataLoader(DATA, G, seed=SEED, rank=0, world_size=1)
    seen, kept, dropped = [], None, False
    for epoch in loader.epochs(3):
        for _, y in loader:
            if epoch == 1 and not dropped:  # its first step dropped: taken again
                loader.load_state_dict(kept)
                dropped = True
                continue
            seen.append((epoch, y.tolist()))
        kept = loader.state_dict()
    assert dropped and seen == [(e, b) for e in range(3) for b in expected(e)]


def test_a_step_starts_once_before_each_of_its_micro_batches_and_never_at_an_epochs_end():
    """``before_step`` (where a job in place takes a joiner in) runs once per step, before
    the step's first micro-batch, and not at the end of an epoch, where no step follows:
    the members would take in a process for a step none of them takes."""
    loader = DataLoader(DATA, G, batch_size=4, seed=SEED, rank=1, world_size=2)
    events = []
    loader.before_step = lambda: events.append(("starts", loader.state_dict()["offset"]))
    for epoch in loader.epochs(2):
        for _ in loader:
            events.append(("batch", epoch))
    step = [("batch", 0)] * loader.accumulation
    assert events[:1 + loader.accumulation] == [("starts", 0), *step]
    assert [e for e in events if e[0] == "starts"] == [("starts", k * G)
                                                       for k in range(STEPS)] * 2
    assert len(events) == 2 * STEPS * (1 + loader.accumulation)


def test_the_step_boundary_and_the_position_follow_the_micro_batches_handed_out():
    loader = DataLoader(DATA, G, batch_size=4, seed=SEED, rank=1, world_size=2)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert (loader.global_batch, loader.batch_size, loader.accumulation) == (G, 4, 3)
    assert len(loader) == STEPS * 3 and not loader.is_step_boundary
    handed, boundaries, lengths = [], [], []
    for _, y in itertools.islice(loader, 8):
        handed.append(y.tolist())
        boundaries.append(loader.is_step_boundary)
        lengths.append(len(loader))
    assert boundaries == [False, False, True] * 2 + [False, False]
    assert lengths == list(range(STEPS * 3 - 1, STEPS * 3 - 9, -1))
    # stopped inside the third global batch: the position is the last complete one, and
    # the next iteration hands the third one out again from its first micro-batch
    assert loader.state_dict()["offset"] == 2 * G
    again = [y.tolist() for _, y in itertools.islice(loader, 3)]
    assert again[:2] == handed[6:] and again == [expected(0)[2][(k * 2 + 1) * 4:][:4]
                                                 for k in range(3)]


def test_a_position_of_another_seed_or_global_batch_is_refused():
    loader = DataLoader(DATA, G, seed=SEED, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="saved with seed 8, this run has seed 7"):
        loader.load_state_dict({"epoch": 1, "offset": 48, "seed": 8, "global_batch": G})
    with pytest.raises(ConfigError, match="global batch of 48 samples, and this run has 24"):
        loader.load_state_dict({"epoch": 1, "offset": 48, "seed": SEED, "global_batch": 48})
    assert loader.state_dict()["offset"] == 0


@pytest.mark.parametrize("global_batch, world_size, batch_size, split", [
    (128, 2, None, (64, 1)), (128, 2, 32, (32, 2)), (128, 2, 64, (64, 1)),
    (96, 4, 10, (8, 3)), (24, 1, 5, (4, 6)), (7, 1, 2, (1, 7)), (24, 24, 1, (1, 1))])
def test_split_global_batch_takes_the_fewest_accumulation_steps_that_fit(
        global_batch, world_size, batch_size, split):
    assert split_global_batch(global_batch, world_size, batch_size) == split


def test_an_indivisible_global_batch_names_the_worker_counts_that_divide_it():
    with pytest.raises(ConfigError) as e:
        split_global_batch(100, 3)
    message = str(e.value)
    assert "global batch of 100 samples cannot be split over 3 workers" in message
    assert "Valid worker counts for a global batch of 100: 1, 2, 4, 5, 10, 20, 25, 50, 100;" \
        in message
    assert "the nearest to 3 are 2 and 4" in message and "\n" not in message
    with pytest.raises(ConfigError) as e:  # 5040 has 60 divisors: abbreviated
        DataLoader(TensorDataset(torch.arange(6000)), 5040, rank=0, world_size=11)
    assert "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 15, 16, ..., 5040 (60 in all)" in str(e.value)
    assert "the nearest to 11 are 10 and 12" in str(e.value)
    with pytest.raises(ConfigError, match="the nearest to 200 is 100"):
        split_global_batch(100, 200)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


def test_what_the_order_depends_on_is_refused_and_so_are_impossible_splits():
    with pytest.raises(ConfigError, match="takes no shuffle, drop_last: the order is spotring"):
        DataLoader(DATA, G, rank=0, world_size=1, shuffle=True, drop_last=True)
    with pytest.raises(ConfigError, match="an IterableDataset has no indices"):
        DataLoader(Stream(), G, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="rank 2 is not one of the 2 workers"):
        GlobalBatchSampler(N, G, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="does not split into 2 workers x 5 accumulation"):
        GlobalBatchSampler(N, G, rank=0, world_size=2, accumulation=5)
    with pytest.raises(ConfigError, match="larger than the dataset"):
        GlobalBatchSampler(20, G, rank=0, world_size=1)


def test_rank_and_world_size_default_to_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    loader = DataLoader(DATA, G, seed=SEED)
    assert (loader.batch_sampler.rank, loader.batch_sampler.world_size) == (1, 2)
    assert next(iter(loader))[1].tolist() == expected(0)[0][12:]


@pytest.mark.parametrize("world_size, accumulation, batch_size", [(2, 2, 6), (3, 1, 8),
                                                                  (1, 3, 8)])
def test_the_trainers_in_memory_batches_are_the_same_order_as_the_data_loader(
        world_size, accumulation, batch_size):
    dataset = Dataset("tiny", Split(IMAGES.contiguous(), torch.arange(N)),
                      Split(IMAGES[:10], torch.arange(10)), N, (0.0,), (1.0,))
    for rank in range(world_size):
        batches = Batches(dataset, global_batch=G, rank=rank, world_size=world_size,
                          accumulation=accumulation, seed=SEED, augment=False,
                          device=torch.device("cpu"))
        loader = DataLoader(DATA, G, batch_size=batch_size, seed=SEED, rank=rank,
                            world_size=world_size)
        assert loader.accumulation == accumulation
        loader.load_state_dict({"epoch": 2, "offset": 3 * G, "seed": SEED, "global_batch": G})
        from_memory = [(x, y) for batch in batches.train(2, 3 * G) for x, y in batch.micro]
        from_loader = list(loader)
        assert len(from_memory) == len(from_loader) == (STEPS - 3) * accumulation
        for (x, y), (images, labels) in zip(from_memory, from_loader, strict=True):
            assert torch.equal(y, labels)
            assert torch.equal((x * 255).round().to(torch.uint8), images)  # x = images / 255
