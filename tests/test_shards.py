"""spotring.Shards: datasets streamed from a store in shards, with the same samples at any
world size (issue 46, docs/streaming.md).

- the sample-key audit: 2 ranks stopped by SIGTERM, resumed on 3, one of those killed,
  resumed on 1: every global batch holds the keys of an uninterrupted run's, each epoch
  every key once, the final weights the uninterrupted run's (float64, 1e-10);
- locality: on 1, 2 and 4 ranks each reads its share plus at most two partial blocks per
  run of the order (the issue's bound: plus two shards);
- shuffle quality on class-sorted shards against a full random permutation;
- the faults: a missing shard and an unreadable store exit 2 before training, naming
  them; a corrupt shard and cut reads are retried, then fail naming the shard;
- the cache: bounded while a dataset 4x larger trains, reused after a restart, never
  stale after a shard is written again; one download per block for several loader
  workers;
- loader workers started by a forkserver (Python 3.14's default) read what the loop does;
- the trainer's dataset=shards, and the summary's and the ledger's reads per rank.

The stores are real: a directory, and the moto server (tests/conftest.py's ``s3``),
behind a relay that cuts answers midway where a test asks for that (harness/shard_faults.py).
Ranks are spawned by the test (harness/ranks.py) and run harness/shard_workload.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness import ranks, shard_workload, workloads
from harness.ranks import Ranks
from harness.shard_faults import CuttingRelay
from spotring.exits import EXIT_CONFIG, EXIT_PEER_LOST, EXIT_PREEMPTED, ConfigError
from spotring.launch import ledger
from spotring.launch.rundir import RunDir
from spotring.loader import DataLoader
from spotring.shards import ImageAndLabel, ShardError, Shards, write
from spotring.stores import open_store
from tests.conftest import assert_close, run_trainer

STEPS = 2 * shard_workload.STEPS_PER_EPOCH


def written(uri: str, items: list, per_shard: int, block: int) -> Shards:
    write(items, uri, samples_per_shard=per_shard, block_samples=block, progress=False)
    return uri


def blobs(n: int, size: int = 1000) -> list[dict[str, bytes]]:
    """``n`` samples of ``size`` random bytes each (about 2 KB in a tar)."""
    g = torch.Generator().manual_seed(n)
    return [{"bin": torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)
             .numpy().tobytes()} for _ in range(n)]


def epoch(shards: Shards, world_size: int, rank: int, global_batch: int, number: int = 0,
          **kwargs) -> list:
    """Rank ``rank``'s micro-batches of epoch ``number``, read through spotring's
    DataLoader."""
    loader = DataLoader(shards, global_batch, rank=rank, world_size=world_size, **kwargs)
    loader.set_epoch(number)
    return list(loader)


# ------------------------------------------------------------------- the key audit


@pytest.mark.slow
@pytest.mark.ends
def test_every_global_batch_keeps_its_keys_through_sigterm_on_2_sigkill_on_3_resume_on_1(
        tmp_path, s3):
    uri = "s3://spotring/audit"
    written(uri, shard_workload.samples(), shard_workload.SAMPLES_PER_SHARD,
            shard_workload.BLOCK_SAMPLES)
    args = {"uri": uri, "steps": STEPS}
    reference = tmp_path / "reference"
    output = ranks.run(reference, 2, shard_workload.train, cache_dir=str(tmp_path / "c0"),
                       **args)
    expected = shard_workload.keys_by_step(output, 2)
    assert sorted(expected) == list(range(1, STEPS + 1))
    # The summary gives each rank's GETs and bytes per epoch: the two ranks of a node
    # fetched each block once between them (8 shards: 7 blocks each, 5 in the last), and
    # nothing in epoch 2, whose blocks were all in the cache.
    reads = json.loads((reference / "summary.json").read_text())["data_reads"]
    gets = {(r["epoch"], r["rank"]): r["gets"] for r in reads if r["dataset"] == uri}
    assert gets.keys() == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert gets[0, 0] > 0 and gets[0, 1] > 0 and gets[0, 0] + gets[0, 1] == 7 * 7 + 5
    assert gets[1, 0] == gets[1, 1] == 0

    run = tmp_path / "run"
    with Ranks(run, 2, shard_workload.train, cache_dir=str(tmp_path / "c1"), hold_at=10,
               **args) as job:  # each run on fresh nodes: an empty cache
        assert job.until(lambda: job.step() >= 10, "step 10")
        job.signal(1, signal.SIGTERM)
        workloads.release(run)
        assert job.wait() == [EXIT_PREEMPTED] * 2, job.output()[-4000:]
        first = job.output()
    (run / "go").unlink()
    # The killed rank's peers learn of it from their closed connections at once: the
    # timeout only has to outlast a loaded machine's stalls.
    with Ranks(run, 3, shard_workload.train, cache_dir=str(tmp_path / "c2"), hold_at=40,
               timeout_s=60, **args) as job:
        assert job.until(lambda: job.step() >= 40, "step 40")
        job.signal(2, signal.SIGKILL)
        workloads.release(run)
        assert job.wait()[:2] == [EXIT_PEER_LOST] * 2, job.output()[-4000:]
        second = job.output()
    last = ranks.run(run, 1, shard_workload.train, cache_dir=str(tmp_path / "c3"), **args)

    stopped, resumed = (int(re.search(r"resumed from \S+ at step (\d+)", out)[1])
                        for out in (second, last))
    assert 10 <= stopped < 40 and resumed == 32, (stopped, resumed)
    runs = [(shard_workload.keys_by_step(first, 2), 1, stopped),
            (shard_workload.keys_by_step(second, 3), stopped + 1, resumed),
            (shard_workload.keys_by_step(last, 1), resumed + 1, STEPS)]
    history = {}
    for keys, begin, end in runs:
        assert all(keys[s] == expected[s] for s in keys), "a batch differs from the reference"
        history |= {s: keys[s] for s in range(begin, end + 1)}  # KeyError: a step skipped
    assert history == expected
    for number in range(2):  # every key once an epoch: 0 duplicates, 0 skips
        steps = range(number * shard_workload.STEPS_PER_EPOCH + 1,
                      (number + 1) * shard_workload.STEPS_PER_EPOCH + 1)
        seen = [k for s in steps for k in history[s]]
        assert sorted(seen) == sorted(f"{i:06d}" for i in range(shard_workload.SAMPLES))
    assert_close(workloads.weights(run), workloads.weights(reference), 1e-10)


# ------------------------------------------------------------------------- locality


@pytest.mark.slow
@pytest.mark.parametrize("store", ["directory", "s3"])
def test_each_rank_reads_its_share_plus_at_most_two_partial_blocks_per_run(
        tmp_path, s3, store):
    """2400 samples of about 2 KB in 8 shards of 300, blocks of 16, global batch 24: each
    rank of 1, 2 and 4 (each a node of its own: an empty cache) reads the blocks of its
    K runs of the order once, which is its share and at most a partial block at each end
    of each run; on 2 ranks with 2 micro-steps too, and with 2 loader workers sharing a
    cache, every block is still fetched once."""
    uri = str(tmp_path / "shards") if store == "directory" else "s3://spotring/locality"
    written(uri, blobs(2400), 300, 16)
    index = Shards(uri, cache_dir=tmp_path / "c").index
    total = sum(s.size for s in index.shards)
    largest_block = max(end - start for shard in index.shards
                        for start, end in (shard.block_range(n, 16) for n in range(19)))
    largest_shard = max(s.size for s in index.shards)
    for world_size, batch_size, workers in [(1, None, 0), (2, None, 2), (4, None, 0),
                                            (2, 6, 0)]:
        accumulation = 24 // world_size // (batch_size or 24 // world_size)
        read = []
        for rank in range(world_size):
            shards = Shards(uri, cache_dir=tmp_path / f"{world_size}-{batch_size}-{rank}")
            epoch(shards, world_size, rank, 24, batch_size=batch_size, num_workers=workers)
            gets, size = shards.reads()[0]
            read.append(size)
            share = total / world_size
            assert size <= share + 2 * accumulation * largest_block, (world_size, rank, size)
            assert size <= share + 2 * largest_shard  # the bound
            assert gets == len(list(Path(shards.cache_dir).glob("*-0*")))  # once each
        # Together the ranks read the dataset about once: a block two runs share, twice.
        assert sum(read) <= total + 2 * world_size * accumulation * largest_block


def test_class_sorted_shards_mix_within_the_bound_of_a_full_random_permutation(tmp_path):
    """Ten classes of 600 samples, each class a shard of its own: the mean total variation
    distance between each global batch's class histogram and the dataset's is within
    1.25x of a full random permutation's (here the blocks of 16 are far shorter than a
    stream, L = 6000 // 64 = 93)."""
    labels = [i // 600 for i in range(6000)]
    uri = written(str(tmp_path / "sorted"), [{"cls": y} for y in labels], 600, 16)
    shards = Shards(uri, decode=lambda s: int(s["cls"]), cache_dir=tmp_path / "c")

    def tvd(batches: torch.Tensor) -> float:  # global batches x G labels
        histogram = torch.nn.functional.one_hot(batches, 10).double().mean(1)
        return 0.5 * (histogram - 0.1).abs().sum(1).mean().item()

    ours = [tvd(torch.cat(epoch(shards, 1, 0, 64, number)).view(-1, 64)) for number in range(2)]
    full = [tvd(torch.tensor(labels)[torch.randperm(6000, generator=torch.Generator()
                                                    .manual_seed(s))][:93 * 64].view(93, 64))
            for s in range(8)]
    ratio = (sum(ours) / len(ours)) / (sum(full) / len(full))
    print(f"shuffle: mean TVD {sum(ours) / len(ours):.4f} against a permutation's "
          f"{sum(full) / len(full):.4f}: {ratio:.3f}x")
    assert ratio <= 1.25, ratio


# --------------------------------------------------------------------------- faults


@pytest.mark.slow
def test_a_missing_shard_exits_2_before_training_naming_it(tmp_path):
    uri = written(str(tmp_path / "shards"), shard_workload.samples(), 50, 8)
    (tmp_path / "shards" / "shard-000003.tar").unlink()
    output = ranks.run(tmp_path / "run", 1, shard_workload.train, expect=EXIT_CONFIG, uri=uri,
                       cache_dir=str(tmp_path / "c"), steps=4)
    assert "shard shard-000003.tar is in its index but not in the store" in output
    assert "step 1 " not in output


def test_an_unreadable_store_or_a_stale_index_is_refused_naming_it(tmp_path, s3):
    with pytest.raises(ConfigError, match="no-such-bucket"):
        Shards("s3://no-such-bucket/data", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="no shards there"):
        Shards(str(tmp_path / "empty"), cache_dir=tmp_path)
    uri = written(str(tmp_path / "shards"), blobs(100), 50, 8)
    shard = tmp_path / "shards" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes() + bytes(512))
    with pytest.raises(ConfigError, match="shard-000001.tar is .* its index says"):
        Shards(uri, cache_dir=tmp_path)


@pytest.mark.parametrize("store", ["directory", "s3"])
def test_a_corrupt_shard_is_read_again_then_fails_naming_it(tmp_path, s3, store):
    uri = str(tmp_path / "shards") if store == "directory" else f"s3://spotring/corrupt-{store}"
    written(uri, blobs(96), 48, 8)
    target = open_store(uri, paths=True)
    data = bytearray(target.read("shard-000001.tar"))
    data[5000] ^= 0xFF  # inside sample 2, so in block 0 of the shard: same size
    target.write("shard-000001.tar", bytes(data))
    shards = Shards(uri, cache_dir=tmp_path / "c", retries=3)
    with pytest.raises(ShardError, match=r"shard-000001.tar: bytes 0\.\.\d+ \(block 0\) could "
                                         r"not be read whole in 3 tries"):
        epoch(shards, 1, 0, 12)
    assert shards.reads()[0][0] >= 3  # the block three times, beside the others read


def test_a_read_cut_midway_is_retried_and_one_cut_every_time_fails_naming_the_shard(
        tmp_path, s3, monkeypatch):
    uri = written("s3://spotring/cut", blobs(96), 48, 8)
    relay = CuttingRelay(s3["AWS_ENDPOINT_URL"], after_bytes=4000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
    try:
        shards = Shards(uri, cache_dir=tmp_path / "once", retries=3)
        relay.cut(1)  # the next answer is cut: its read is tried again
        batches = epoch(shards, 1, 0, 12, collate_fn=lambda items: [i["__key__"] for i in items])
        assert sorted(k for b in batches for k in b) == [f"{i:06d}" for i in range(96)]
        assert relay.cuts == 0
        shards = Shards(uri, cache_dir=tmp_path / "always", retries=3)
        relay.cut(10**6)
        with pytest.raises(ShardError, match=r"s3://spotring/cut/shard-00000\d.tar: bytes .* "
                                             "could not be read whole in 3 tries"):
            epoch(shards, 1, 0, 12)
    finally:
        relay.close()


# ---------------------------------------------------------------------------- cache


def cache_bytes(folder: Path) -> int:
    """Bytes of blocks (and downloads in flight) in a dataset's cache folder, each block
    once: a listing taken while a download is renamed to its block may show both names."""
    sizes: dict[str, int] = {}
    for p in folder.iterdir():
        if p.name.startswith(".") and not p.name.endswith(".tmp"):
            continue
        with contextlib.suppress(FileNotFoundError):  # renamed or evicted meanwhile
            block = p.name.lstrip(".").split(".")[0]  # a download's ".BLOCK.PID.TID.tmp"
            sizes[block] = max(sizes.get(block, 0), p.stat().st_size)
    return sum(sizes.values())


def test_a_dataset_4x_the_cache_trains_within_it_reading_each_block_once(tmp_path):
    uri = written(str(tmp_path / "shards"), blobs(2400), 300, 16)
    total = sum(p.stat().st_size for p in (tmp_path / "shards").glob("*.tar"))
    shards = Shards(uri, cache_dir=tmp_path / "c", cache_limit=total // 4)
    loader = DataLoader(shards, 8, rank=0, world_size=1)
    loader.set_epoch(0)
    most = 0
    for _ in loader:
        most = max(most, cache_bytes(shards.cache_dir))
    assert 0 < most <= total // 4
    assert shards.reads()[0][1] <= total  # no block fetched twice


def test_a_restart_reuses_the_cache_and_a_shard_written_again_is_never_served_stale(tmp_path):
    uri = written(str(tmp_path / "shards"), [{"cls": i % 7} for i in range(200)], 50, 8)
    decode = lambda s: int(s["cls"])  # noqa: E731
    first = Shards(uri, decode=decode, cache_dir=tmp_path / "c")
    labels = torch.cat(epoch(first, 1, 0, 10)).tolist()
    again = Shards(uri, decode=decode, cache_dir=tmp_path / "c")
    assert torch.cat(epoch(again, 1, 0, 10)).tolist() == labels
    assert again.reads() == {0: (0, 0)}  # every block from the cache
    write([{"cls": i % 5} for i in range(200)], uri, samples_per_shard=50, block_samples=8,
          overwrite=True, progress=False)
    changed = Shards(uri, decode=decode, cache_dir=tmp_path / "c")
    read = torch.cat(epoch(changed, 1, 0, 10)).tolist()
    keys = [changed.key(int(i)) for i in changed.start_epoch(0, 0, 10)]
    assert read == [int(k) % 5 for k in keys][:len(read)]


@pytest.mark.slow(cores=1)
def test_loader_workers_of_a_fresh_interpreter_read_the_batches_of_the_loop(tmp_path):
    """Loader workers started by a forkserver, Python 3.14's default on Linux: the dataset
    reaches them pickled, not copied by fork (each opens the store again from its URI; the
    read counters are in shared memory). They hand out the samples the training loop
    reads itself, and their reads are counted."""
    # In a directory: the forkserver is this process's, started by whichever test came
    # first, with the environment of then (another test's moto endpoint, or none).
    uri = written(str(tmp_path / "shards"), [{"cls": i % 7} for i in range(120)], 30, 8)

    def keys(shards: Shards, **kwargs) -> list[str]:
        return sum((batch["__key__"] for batch in epoch(shards, 2, 1, 12, **kwargs)), [])

    alone = Shards(uri, cache_dir=tmp_path / "alone")
    shards = Shards(uri, cache_dir=tmp_path / "workers")
    assert keys(shards, num_workers=2, multiprocessing_context="forkserver") == keys(alone)
    assert shards.reads()[0] == alone.reads()[0]  # the workers' reads, each block once


# ---------------------------------------------------------- the trainer, the summary


def test_the_writer_and_the_index_of_shards_written_elsewhere_agree(tmp_path):
    """`spotring shards write`'s Python call and `spotring shards index` (shards written
    without spotring, here by Python's tarfile as WebDataset's writer does) index the
    same samples: the keys, the .cls classes, the first image's shape."""
    images = [(torch.randint(0, 256, (3, 6, 5), dtype=torch.uint8), i % 4) for i in range(30)]
    index = write(images, str(tmp_path / "ours"), samples_per_shard=16, progress=False)
    assert (index.classes, index.shape, index.counts) == (4, [3, 6, 5], [16, 14])
    (tmp_path / "ours" / "index.json").rename(tmp_path / "kept.json")
    from spotring.shards.command import main

    assert main(["index", str(tmp_path / "ours")]) == 0
    again = json.loads((tmp_path / "ours" / "index.json").read_text())
    assert again == json.loads((tmp_path / "kept.json").read_text())
    shards = Shards(str(tmp_path / "ours"), decode=ImageAndLabel(), cache_dir=tmp_path / "c")
    image, label = shards[17]
    assert label == 17 % 4 and torch.equal((image * 255).round().to(torch.uint8), images[17][0])


@pytest.mark.slow
def test_the_trainer_streams_shards_from_s3_and_reports_reads_per_rank_per_epoch(
        tmp_path, s3):
    """dataset=shards on 2 spawned ranks, from shards in moto's S3: it trains, reads no
    dataset files of its own (data.root stays empty), and summary.json gives each rank's
    GET requests and bytes (per epoch: the audit above checks the epochs)."""
    g = torch.Generator().manual_seed(0)
    images = [(torch.randint(0, 256, (1, 28, 28), generator=g, dtype=torch.uint8), i % 10)
              for i in range(640)]
    write(images, "s3://spotring/tiny/train", samples_per_shard=100, progress=False)
    write(images[:64], "s3://spotring/tiny/test", samples_per_shard=100, progress=False)
    empty = tmp_path / "data"
    empty.mkdir()
    run = run_trainer(tmp_path / "run", "dataset=shards", "dataset.uri=s3://spotring/tiny/train",
                      "dataset.test_uri=s3://spotring/tiny/test", "train.max_steps=8",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "train.batch_size=32",
                      f"data.root={empty}", "data.workers=1", launcher="spawned", nproc=2)
    assert list(empty.iterdir()) == []
    reads = [r for r in run.summary["data_reads"] if r["dataset"].endswith("/train")]
    # Both ranks' rows; the two share the node's cache, so between them each of the 14
    # blocks (7 shards of 100 samples, blocks of 64) was fetched once at most.
    assert {r["rank"] for r in reads} == {0, 1}
    assert 0 < sum(r["gets"] for r in reads) <= 14



def test_the_ledger_gives_the_jobs_reads_per_rank_per_epoch(tmp_path):
    """`spotring launch`'s ledger.json carries what the job's summary.json says of its
    reads (the trainer's, as the test above makes it)."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    OmegaConf.save({"cluster": {"name": "local"}}, run.config)
    run.save_nodes([])
    run.save(destroyed_at=1.0, tries=[])
    run.job.mkdir()
    reads = [{"dataset": "s3://bucket/train", "epoch": 0, "rank": r, "gets": 3 + r,
              "bytes": 4096 * (3 + r)} for r in range(2)]
    (run.job / "summary.json").write_text(json.dumps({"steps": 8, "epochs": 1.0,
                                                      "data_reads": reads}))
    assert ledger.build(run, now=2.0)["data_reads"] == reads
