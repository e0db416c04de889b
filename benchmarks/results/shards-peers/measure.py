"""Issue 46's comparison against the peers (results.md here): spotring.Shards, WebDataset,
LitData and Mosaic Streaming read the same 60,000 MNIST training images, PNG, from moto's
S3 on loopback, side by side in one run.

    python3.11 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 webdataset==1.0.2 \\
        litdata==0.2.76 mosaicml-streaming==0.13.0 'moto[server]==5.2.5' boto3==1.44.5
    echo $PWD > /tmp/peers-venv/lib/python3.11/site-packages/spotring-repo.pth  # spotring
    /tmp/peers-venv/bin/python benchmarks/results/shards-peers/measure.py         # ~15 min

A try on less: PEERS_SAMPLES=3000 PEERS_ROUNDS=1 PEERS_OUT=try.json (the first 3,000
samples, the audit's stop scaled to 5 steps). The peers live in a virtualenv of their own,
not the project's .venv; spotring is read from the checkout (the .pth).

1. Conversion: MNIST (torchvision's files in data/) into each format in the bucket, each
   image encoded as PNG by Pillow, one process each, timed from its start to its end:
   spotring.shards.write, the call behind `spotring shards write mnist` (WebDataset reads
   the same tar shards), LitData's optimize(), Mosaic's MDSWriter; ~1,000 samples a shard.
2. img/s: one rank reads one epoch from an empty cache, PNG decoded to a uint8 tensor by
   one function for all (spotring.shards.dataset.decode_image), global batch G = 192,
   2 loader workers; ROUNDS rounds, the libraries in turn (the machine's load weighs on
   all alike).
3. Bytes per rank: each GET's response bytes, counted by the S3 server (in this process)
   per access key: every reader process gets a key of its own. 1 rank: the img/s runs;
   2 ranks: one epoch, keys only (no decode), each rank its own cache (a node of its own).
4. The audit: 2 ranks take K steps, "stop"; 3 ranks resume from rank 0's state by the
   library's own state_dict/load_state_dict, to the end of the epoch; the stitched
   epoch's global batches (keys) are compared with those of the uninterrupted 2-rank run.
   WebDataset has no state_dict: its resume starts the epoch again on 3 ranks and skips
   the K steps taken (the usual stand-in, as Accelerate's skip_first_batches).

Ranks are simulated one process at a time, each told its rank by the library's own
settings: spotring.DataLoader(rank=, world_size=); WebDataset's RANK and WORLD_SIZE
(split_by_node); LitData's WORLD_SIZE, GLOBAL_RANK and NNODES; Mosaic's RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE (1: a node per rank). Mosaic sets up torch.distributed
itself where WORLD_SIZE > 1, for barriers only; with one rank at a time that set-up is
skipped (maybe_init_dist), and each rank computes its partition alone, as it does anyway.
WebDataset has no reader for s3:// of its own (its users pipe `aws s3 cp`): a gopen
handler here streams each shard with one boto3 GET.

Into results.json here (after each part, so a run cut short keeps what it had); the
tables of results.md are written from it by hand.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BUCKET = "peers"
LIBRARIES = ("spotring", "webdataset", "litdata", "mosaic")
SAMPLES = int(os.environ.get("PEERS_SAMPLES", 60000))  # MNIST's training set; less: a try
PER_SHARD = 1000
G = 192  # the global batch: 192 on 1 rank, 96 on 2, 64 on 3
WORKERS = 2  # DataLoader workers per rank
SEED = 0
K = max(1, round(100 * SAMPLES / 60000))  # steps before the audit's "stop" (of 312)
ROUNDS = int(os.environ.get("PEERS_ROUNDS", 5))
# Each reader's cache (LitData's, Mosaic's local, spotring's cache_dir), emptied before
# each process: every rank is a node of its own with the same path (LitData's state_dict
# names it and refuses another).
CACHE = Path(tempfile.gettempdir()) / "spotring-peers-cache"


# ------------------------------------------------------------------ the S3 server

class Counting:
    """moto's WSGI app, counting each GET's response bytes by the request's access key
    (SigV4's Credential=KEY/..., in the header or a presigned URL's query)."""

    def __init__(self, app):
        self.app, self.lock = app, threading.Lock()
        self.bytes, self.gets = collections.Counter(), collections.Counter()

    def __call__(self, environ, start_response):
        body = self.app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return body
        signed = environ.get("HTTP_AUTHORIZATION", "") + environ.get("QUERY_STRING", "")
        found = re.search(r"Credential=([^/%]+)", signed)
        who = found.group(1) if found else "anonymous"
        with self.lock:
            self.gets[who] += 1

        def counted():
            try:
                for chunk in body:
                    with self.lock:
                        self.bytes[who] += len(chunk)
                    yield chunk
            finally:
                if hasattr(body, "close"):
                    body.close()
        return counted()


def serve() -> tuple[Counting, str]:
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    counting = Counting(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counting, threaded=True,
                         request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return counting, f"http://127.0.0.1:{server.server_address[1]}"


def env(endpoint: str, key: str, rank: int = 0, world: int = 1) -> dict[str, str]:
    """A reader's environment: the store, an access key of its own, its rank as each
    library reads it."""
    return os.environ | {
        "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint,  # boto3's, Mosaic's
        "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GLOBAL_RANK": str(rank), "NNODES": str(world), "WDS_SEED": str(SEED),
        "TQDM_DISABLE": "1"}


class Failed(RuntimeError):
    """A child process that failed: the last lines of its stderr."""


def child(job: dict, environ: dict[str, str]) -> dict:
    """This script run again as one process for ``job``, its cache empty; its answer."""
    shutil.rmtree(CACHE, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        answer = Path(scratch) / "answer.json"
        done = subprocess.run([sys.executable, __file__, "child", json.dumps(job | {
            "answer": str(answer)})], env=environ, cwd=REPO, stderr=subprocess.PIPE, text=True)
        shutil.rmtree(CACHE, ignore_errors=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "Warning" not in line
                     and "warnings.warn" not in line]
            raise Failed("\n".join(lines[-6:]))
        return json.loads(answer.read_text())


def stored(prefix: str) -> tuple[int, int, int]:
    """(objects, bytes, the largest object's bytes) under s3://BUCKET/PREFIX."""
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=prefix + "/")
    sizes = [o["Size"] for page in pages for o in page.get("Contents", [])]
    return len(sizes), sum(sizes), max(sizes)


# ------------------------------------------------------------------ the parts

def convert(endpoint: str) -> dict:
    """1: each format written into the bucket, the time of its process; WebDataset reads
    spotring's shards."""
    results = {}
    for library in ("spotring", "litdata", "mosaic"):
        start = time.perf_counter()
        child({"job": "convert", "library": library}, env(endpoint, "convert"))
        results[library] = {"seconds": time.perf_counter() - start}
    results["spotring"]["what"] = "spotring.shards.write: tar shards and index.json"
    results["litdata"]["what"] = "litdata.optimize(num_workers=1)"
    results["mosaic"]["what"] = "streaming.MDSWriter"
    for library, prefix in (("spotring", "spotring/train"), ("litdata", "litdata"),
                            ("mosaic", "mosaic")):
        objects, size, largest = stored(prefix)
        results[library] |= {"objects": objects, "bytes": size, "largest_object": largest}
    return results


def rates(counting: Counting, endpoint: str) -> dict:
    """2 and 3 (1 rank): one epoch each, decoded, the libraries in turn."""
    results = {library: [] for library in LIBRARIES}
    for round_ in range(ROUNDS):
        for library in LIBRARIES if round_ % 2 == 0 else LIBRARIES[::-1]:
            key = f"rate-{library}-{round_}"
            got = child({"job": "read", "library": library, "world": 1, "rank": 0,
                         "decode": True}, env(endpoint, key))
            results[library].append({
                "img_per_s": got["samples"] / got["seconds"], "samples": got["samples"],
                "seconds": got["seconds"], "first_batch_s": got["first_batch_s"],
                "gets": counting.gets[key], "bytes": counting.bytes[key],
                "load": os.getloadavg()})
    return results


def epoch(counting: Counting, endpoint: str, library: str, world: int, name: str,
          steps: int | None = None, state: str | None = None, save: str | None = None) -> dict:
    """Every rank of ``world`` in turn, keys only: their keys per step, GETs and bytes."""
    ranks = []
    for rank in range(world):
        key = f"{name}-{library}-w{world}-r{rank}"
        got = child({"job": "read", "library": library, "world": world, "rank": rank,
                     "decode": False, "steps": steps, "state": state,
                     "save": save if rank == 0 else None}, env(endpoint, key, rank, world))
        ranks.append({"keys": got["keys"], "gets": counting.gets[key],
                      "bytes": counting.bytes[key], "seconds": got["seconds"]})
    return {"ranks": ranks}


def global_batches(run: dict) -> list[list[str]]:
    """Global batch i: every rank's batch i, while every rank has one (the ranks step
    together)."""
    steps = min(len(rank["keys"]) for rank in run["ranks"])
    return [sorted(k for rank in run["ranks"] for k in rank["keys"][i]) for i in range(steps)]


def audit(reference: list[list[str]], before: list[list[str]], after: list[list[str]]) -> dict:
    """The stopped-and-resumed epoch (before + after) against the uninterrupted one."""
    stitched = before + after
    seen = collections.Counter(k for batch in stitched for k in batch)
    wanted = collections.Counter(k for batch in reference for k in batch)
    same = sum(a == b for a, b in zip(stitched, reference, strict=False))
    return {
        "steps": len(stitched), "steps_uninterrupted": len(reference),
        "global_batches_equal": same,
        "global_batches_equal_after_resume": sum(
            a == b for a, b in zip(after, reference[len(before):], strict=False)),
        "duplicates": sum((seen - wanted).values()),  # taken more often than uninterrupted
        "skips": sum((wanted - seen).values()),  # taken less often
        "repeats_in_uninterrupted": sum(n - 1 for n in wanted.values() if n > 1),
    }


def main() -> None:
    os.chdir(REPO)
    counting, endpoint = serve()
    os.environ.update({k: v for k, v in env(endpoint, "setup").items()
                       if k.startswith("AWS_") or k == "S3_ENDPOINT_URL"})
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    results = {"load_before": os.getloadavg(), "versions": versions(),
               "settings": {"samples": SAMPLES, "samples_per_shard": PER_SHARD,
                            "global_batch": G, "loader_workers": WORKERS, "seed": SEED,
                            "audit_stop_after_steps": K, "rounds": ROUNDS}}
    out = HERE / os.environ.get("PEERS_OUT", "results.json")

    def save(done: str) -> None:  # after each part: a run cut short keeps what it had
        results["done"] = done
        out.write_text(json.dumps(results, indent=2, default=str))
        print(f"{time.strftime('%H:%M:%S')} {done}", flush=True)

    results["convert"] = convert(endpoint)
    results["load_after_convert"] = os.getloadavg()
    save("convert")
    results["rate_1_rank"] = rates(counting, endpoint)
    results["load_after_rates"] = os.getloadavg()
    save("rates")
    results["bytes_2_ranks"], results["audit"] = {}, {}
    for library in LIBRARIES:
        state = tempfile.mktemp(suffix=".state")
        whole = epoch(counting, endpoint, library, 2, "uninterrupted")
        results["bytes_2_ranks"][library] = [
            {"gets": r["gets"], "bytes": r["bytes"], "samples": sum(map(len, r["keys"]))}
            for r in whole["ranks"]]
        stopped = epoch(counting, endpoint, library, 2, "stopped", steps=K, save=state)
        try:
            resumed = epoch(counting, endpoint, library, 3, "resumed", state=state)
        except Failed as e:  # the library refuses the resume: its error
            results["audit"][library] = {"resume_failed": str(e)}
        else:
            results["audit"][library] = audit(global_batches(whole), global_batches(stopped),
                                              global_batches(resumed))
        results["audit"][library]["state"] = pickle.loads(Path(state).read_bytes())
        os.unlink(state)
        print(library, {k: v for k, v in results["audit"][library].items() if k != "state"},
              flush=True)
        save(f"audit {library}")
    results["load_after"] = os.getloadavg()
    save("all")
    print(json.dumps({k: v for k, v in results.items() if k != "audit"}, indent=2, default=str))


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in (
        "torch", "torchvision", "webdataset", "litdata", "mosaicml-streaming", "moto",
        "boto3", "pillow")} | {"python": sys.version.split()[0]}


# ------------------------------------------------------------------ in the child processes

def item(png: bytes, label, key: str, decode: bool):
    """One sample as every library hands it to training: the image (PNG decoded to a uint8
    tensor C x H x W; empty where only keys are wanted), the label, the key."""
    import torch

    from spotring.shards.dataset import decode_image

    return (decode_image(png) if decode else torch.empty(0, dtype=torch.uint8)), int(label), key


class TarItem:  # spotring's and WebDataset's samples: the tar members by extension
    def __init__(self, decode: bool):
        self.decode = decode

    def __call__(self, sample: dict):
        return item(sample["png"], sample["cls"], sample["__key__"], self.decode)


class ColumnItem(TarItem):  # LitData's and Mosaic's samples: the columns written
    def __call__(self, sample: dict):
        return item(sample["png"], sample["cls"], sample["key"], self.decode)


def mnist_png(i: int) -> dict:
    """Sample i of MNIST's training set as each converter writes it (Pillow's PNG, as
    `spotring shards write` encodes it)."""
    image, label = MNIST()[i]
    out = io.BytesIO()
    image.save(out, "PNG")
    return {"key": f"{i:06d}", "png": out.getvalue(), "cls": int(label)}


_mnist = []


def MNIST():
    if not _mnist:
        from torchvision.datasets import MNIST as Torchvision

        _mnist.append(Torchvision(str(REPO / "data"), train=True))
    return _mnist[0]


def litdata_over_http() -> None:
    """LitData's obstore client with plain http (moto's; S3 itself is https): its client
    options replace obstore's own, AWS_ALLOW_HTTP included, so the option goes there."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


def run_convert(job: dict) -> dict:
    uri = f"s3://{BUCKET}/{job['library']}"
    if job["library"] == "spotring":  # `spotring shards write mnist`'s call, on SAMPLES
        import torch

        from spotring.shards import write

        write(torch.utils.data.Subset(MNIST(), range(SAMPLES)), uri + "/train",
              samples_per_shard=PER_SHARD, progress=False)
    elif job["library"] == "litdata":
        from litdata import optimize

        litdata_over_http()
        optimize(fn=mnist_png, inputs=list(range(SAMPLES)), output_dir=uri,
                 chunk_size=PER_SHARD, num_workers=1, verbose=False)
    else:
        from streaming import MDSWriter

        # MDS shards are cut by size: PER_SHARD times the mean sample's bytes.
        mean = sum(len(mnist_png(i)["png"]) + 16 for i in range(2000)) / 2000
        with MDSWriter(out=uri, columns={"key": "str", "png": "bytes", "cls": "int"},
                       size_limit=int(PER_SHARD * mean), progress_bar=False) as writer:
            for i in range(SAMPLES):
                writer.write(mnist_png(i))
    return {}


def loader(job: dict, cache: str):
    """The library's loader for this rank, restored from job["state"] where given, and
    the function that gives its state_dict (rank 0's is what every rank resumes from)."""
    per_rank = G // job["world"]
    state = pickle.loads(Path(job["state"]).read_bytes()) if job.get("state") else None
    library = job["library"]
    if library == "spotring":
        import spotring
        from spotring.shards import Shards

        shards = Shards(f"s3://{BUCKET}/spotring/train", decode=TarItem(job["decode"]),
                        cache_dir=cache)
        data = spotring.DataLoader(shards, G, seed=SEED, rank=job["rank"],
                                   world_size=job["world"], num_workers=WORKERS)
        if state:
            data.load_state_dict(state)
        data.set_epoch(0)
        return data, data.state_dict
    if library == "webdataset":
        import boto3
        import webdataset as wds

        def gopen_s3(url, mode="rb", bufsize=8192, **kw):
            bucket, key = url.removeprefix("s3://").split("/", 1)
            return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"]

        wds.gopen_schemes["s3"] = gopen_s3
        urls = [f"s3://{BUCKET}/spotring/train/shard-{i:06d}.tar"
                for i in range(SAMPLES // PER_SHARD)]
        dataset = (wds.WebDataset(urls, shardshuffle=100, detshuffle=True, seed=SEED,
                                  nodesplitter=wds.split_by_node, empty_check=False)
                   .shuffle(1000, seed=SEED).map(TarItem(job["decode"]))
                   .batched(per_rank, partial=False))
        data = wds.WebLoader(dataset, batch_size=None, num_workers=WORKERS)
        # No state_dict: a resumed run starts the epoch again and skips the steps taken
        # (the usual stand-in, as Accelerate's skip_first_batches).
        data.skip = state["steps"] if state else 0
        return data, lambda: None
    if library == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.resolver import Dir

        litdata_over_http()
        dataset = StreamingDataset(Dir(path=cache, url=f"s3://{BUCKET}/litdata"),
                                   shuffle=True, seed=SEED, drop_last=True,
                                   transform=ColumnItem(job["decode"]))
        data = StreamingDataLoader(dataset, batch_size=per_rank, num_workers=WORKERS)
        if state:
            data.load_state_dict(state)
        return data, data.state_dict
    import streaming
    import streaming.base.dataset
    import streaming.base.util

    for module in (streaming.base.dataset, streaming.base.util):  # one rank at a time:
        module.maybe_init_dist = lambda: False  # no torch.distributed, no barriers
    streaming.base.util.clean_stale_shared_memory()

    class Columns(streaming.StreamingDataset):
        def get_item(self, sample_id, retry=7):
            return ColumnItem(job["decode"])(super().get_item(sample_id, retry))

    dataset = Columns(remote=f"s3://{BUCKET}/mosaic", local=cache, shuffle=True,
                      shuffle_seed=SEED, batch_size=per_rank)
    data = streaming.StreamingDataLoader(dataset, batch_size=per_rank, num_workers=WORKERS)
    if state:
        data.load_state_dict(state)
    return data, data.state_dict


def run_read(job: dict) -> dict:
    """One rank's epoch (or its first job["steps"] steps): keys per step, timed from the
    dataset's construction on an empty cache to the last batch."""
    start = time.perf_counter()
    data, state_dict = loader(job, str(CACHE / job["library"]))
    keys, first, samples = [], None, 0
    skip = getattr(data, "skip", 0)
    for step, (_images, _, batch_keys) in enumerate(data):
        if step < skip:
            continue
        first = first or time.perf_counter() - start
        keys.append(list(batch_keys))
        samples += len(batch_keys)
        if len(keys) == job.get("steps"):
            break
    seconds = time.perf_counter() - start
    if job.get("save"):
        state = state_dict() if job["library"] != "webdataset" else {"steps": len(keys)}
        Path(job["save"]).write_bytes(pickle.dumps(state))
    return {"keys": keys, "samples": samples, "seconds": seconds, "first_batch_s": first}


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        job = json.loads(sys.argv[2])
        answer = (run_convert if job["job"] == "convert" else run_read)(job)
        Path(job["answer"]).write_text(json.dumps(answer))
        os._exit(0)  # the libraries' loader workers and threads: no waiting on them
    main()
