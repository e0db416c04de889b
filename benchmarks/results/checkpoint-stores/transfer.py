"""Seconds and MB/s of an upload in parts, and of a download by ranged reads, through
each store (spotring/stores/) to its emulator on 127.0.0.1 (harness/stores.py): the
emulators' and the clients' speed on this machine, not the clouds'.

    .venv/bin/python benchmarks/results/checkpoint-stores/transfer.py [--mb 1024] \
        [--stores directory s3 az gs]

One file of --mb MB (10^6 bytes) of random bytes is uploaded with Store.upload (parts
of PART_BYTES), then read back with Store.read_range, PART_BYTES a request, one after
the other as a checkpoint's reader does, and checked against the file's sha256.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

from spotring.stores import PART_BYTES, open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout, for harness/

from harness.stores import (  # noqa: E402
    environment,
    running_azurite,
    running_gcs_emulator,
    running_moto,
)

RUNNING = {"s3": running_moto, "az": running_azurite, "gs": running_gcs_emulator}


def measure(uri: str, source: Path, digest: str) -> tuple[float, float]:
    """(upload seconds, download seconds) of ``source`` through the store at ``uri``."""
    store = open_store(uri)
    started = time.perf_counter()
    store.upload("transfer.bin", source)
    uploaded = time.perf_counter()
    check, start = hashlib.sha256(), 0
    while chunk := store.read_range("transfer.bin", start, PART_BYTES):
        check.update(chunk)
        start += len(chunk)
    downloaded = time.perf_counter()
    assert check.hexdigest() == digest, f"{uri}: read back other than written"
    store.delete("transfer.bin")
    return uploaded - started, downloaded - uploaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--stores", nargs="+", default=["directory", *RUNNING])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, source = Path(tmp), Path(tmp) / "source.bin"
        digest = hashlib.sha256()
        with open(source, "wb") as f:
            for _ in range(args.mb):
                block = os.urandom(10**6)
                digest.update(block)
                f.write(block)
        print(f"{args.mb} MB, parts of {PART_BYTES / 2**20:g} MiB, on 127.0.0.1 "
              "(emulators, not clouds)")
        print(f"{'store':<10} {'upload s':>9} {'MB/s':>7} {'download s':>11} {'MB/s':>7}")
        for kind in args.stores:
            with contextlib.ExitStack() as stack:
                if kind == "directory":
                    uri = str(folder / "store")
                else:
                    emulator = stack.enter_context(RUNNING[kind](
                        Path(tempfile.mkdtemp(dir=folder))))
                    stack.enter_context(environment(emulator.env()))
                    uri = emulator.uri("transfer")
                up, down = measure(uri, source, digest.hexdigest())
                print(f"{kind:<10} {up:>9.1f} {args.mb / up:>7.1f} {down:>11.1f} "
                      f"{args.mb / down:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
