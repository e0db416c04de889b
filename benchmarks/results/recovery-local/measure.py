"""How long a lost spot node keeps a user's script from training, on the local cluster
(root; network namespaces with sshd: `make system-deps`), from an installed wheel:

    .venv/bin/python benchmarks/results/recovery-local/measure.py [REPEATS]

For cluster.copy_env=true (the default: the replacement gets a copy of node 0's .venv)
and false (it builds its own), alternately: harness/local_launch.py's launch_with_a_notice
(2 nodes, harness/user_script.py's train.py, a spot notice for node 1 once it trains).
Prints, per launch, each node's environment setup and the seconds from the notice to
the first train record of the resumed job; writes results.json beside this file.
"""

import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from harness.installed import spotring_venv  # noqa: E402
from harness.local_launch import launch_with_a_notice, project  # noqa: E402


def main(repeats: int) -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        venv = spotring_venv(Path(tmp) / "venv")
        for i in range(repeats):
            for copy in ("true", "false"):
                root = project(Path(tmp) / f"p{i}{copy}")
                code, out, run, noticed = launch_with_a_notice(
                    venv, root, Path(tmp) / "runs", f"cluster.copy_env={copy}")
                assert code == 0, out[-3000:]
                setups = re.findall(r"run: node (\d) \(\S+\): environment \w+ (.*)", out)
                resumed = int(re.findall(r"resumed from \S+ at step (\d+)", out)[-1])
                records = [json.loads(line) for line in
                           (run.job / "metrics.jsonl").read_text().splitlines()]
                back = min(r["time"] for r in records
                           if r["kind"] == "train" and r["step"] > resumed and r["time"] > noticed)
                row = {"copy_env": copy, "setups": setups, "notice_to_step_s": back - noticed}
                print(json.dumps(row), flush=True)
                results.append(row)
    (Path(__file__).parent / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
