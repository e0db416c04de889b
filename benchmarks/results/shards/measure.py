"""The closing note's figures for issue 46 (README.md here), in one run on this machine:

1. the trainer's img/s on MNIST and on CIFAR-10-shaped random images, from shards in moto's
   S3 on loopback and from the same shards in a directory (benchmarks/shards.py);
2. the time to the first global batch of 256 on an empty cache, from S3, against shard
   size.

A source whose SOURCE/results.json is here already is not measured again (delete it to
measure again).

    python benchmarks/results/shards/measure.py STEPS
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def first_batch(samples_per_shard: int) -> float:
    import torch
    from moto.server import ThreadedMotoServer

    from spotring.loader import DataLoader
    from spotring.shards import Shards, write
    from spotring.stores import open_store

    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="x",
                      AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
    open_store("s3://first").client.create_bucket(Bucket="first")
    g = torch.Generator().manual_seed(0)
    images = [(torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8), i % 10)
              for i in range(10000)]
    write(images, f"s3://first/d{samples_per_shard}", samples_per_shard=samples_per_shard, progress=False)
    start = time.perf_counter()
    shards = Shards(f"s3://first/d{samples_per_shard}", cache_dir=tempfile.mkdtemp())
    next(iter(DataLoader(shards, 256, rank=0, world_size=1, num_workers=2)))
    seconds = time.perf_counter() - start
    server.stop()
    return seconds


def main(steps: str) -> None:
    results = {"load_before": os.getloadavg()}
    for source in ("mnist", "cifar10-synthetic"):
        out = HERE / source
        if (out / "results.json").exists():  # measured already (delete it to measure again)
            results[source] = json.loads((out / "results.json").read_text())
            continue
        out.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "spotring.benchmarks.shards", source, steps,
                        str(out)], check=True)
        results[source] = json.loads((out / "results.json").read_text())
    results["first_batch_s_by_samples_per_shard"] = {
        n: first_batch(n) for n in (100, 1000, 10000)}
    results["load_after"] = os.getloadavg()
    (HERE / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
