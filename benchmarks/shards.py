"""`python -m spotring.benchmarks.shards mnist|cifar10-synthetic STEPS OUT`: the trainer's
img/s on shards in moto's S3 (loopback) and in a directory, alternated in one run, into
OUT/results.json (docs/streaming.md). Needs moto[server] (the test extra)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from moto.server import ThreadedMotoServer

from spotring.shards import write
from spotring.stores import open_store


def source(name: str, split: str):  # MNIST from data/, or random images of CIFAR-10's shape
    if name == "mnist":
        from torchvision.datasets import MNIST

        return MNIST("data", train=split == "train")
    g = torch.Generator().manual_seed(int(split == "train"))
    return [(torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8), i % 10)
            for i in range(10000 if split == "train" else 1000)]


def rate(uri: str, steps: str, run: Path) -> float:
    """img/s of `spotring train` on URI/train (evaluated on URI/test), its cache empty."""
    subprocess.run([sys.executable, "-m", "spotring.trainer", "dataset=shards", f"dataset.uri="
                    f"{uri}/train", f"dataset.test_uri={uri}/test", f"dataset.cache_dir={run}c",
                    f"train.max_steps={steps}", "train.eval_samples=1000",
                    "telemetry.progress=false", f"hydra.run.dir={run}"], check=True)
    return json.loads((run / "summary.json").read_text())["images_per_second"]


def main(name: str, steps: str, out: str) -> None:
    work, server = Path(tempfile.mkdtemp()), ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="x",
                      AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
    open_store("s3://bench").client.create_bucket(Bucket="bench")
    uris = {"directory": str(work / "shards"), "s3": "s3://bench/shards"}
    for split in ("train", "test"):  # written once, copied to S3 byte for byte
        write(source(name, split), f"{work}/shards/{split}", samples_per_shard=2000)
        for f in (work / "shards" / split).iterdir():
            open_store(f"s3://bench/shards/{split}").upload(f.name, f)
    runs = [[rate(uri, steps, work / f"{kind}{i}") for kind, uri in uris.items()]
            for i in range(2)]  # alternated: the machine's load weighs on both alike
    rates = {kind: [run[k] for run in runs] for k, kind in enumerate(uris)}
    (Path(out) / "results.json").write_text(json.dumps(
        {"source": name, "steps": steps, "img_per_s": rates, "load": os.getloadavg(),
         "s3_over_directory": sum(rates["s3"]) / sum(rates["directory"])}, indent=2))
    server.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4])
