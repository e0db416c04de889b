"""A pip user's project launched on the local cluster (network namespaces, as root)
from an installed wheel (harness/installed.py): the project (``project``: harness/
user_script.py's train.py, and requirements.txt naming a wheel of its own), the
installed command's environment (``installed``), `spotring launch cluster=local
nodes=2 -- python train.py` (``launch``), and such a launch with a spot notice for node
1 once it trains (``launch_with_a_notice``). For tests/test_launch_command.py and
benchmarks/results/recovery-local/measure.py."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

from harness import user_script
from harness.launcher import Followed, launch_with_spares, notice_node_1
from spotring.launch.rundir import RunDir

# The script's run: a global batch of 2, on 2 workers or 1, and 30 steps of the 32 of
# its first epoch (64 samples), so that no stop or checkpoint falls on an epoch's end.
STEPS = ["--steps", "30", "--batch", "2", "--save-every", "4"]
# A dependency of the project's own, installed on the nodes from requirements.txt.
TINYDEP = "tinydep-1.0-py3-none-any.whl"


def project(root: Path) -> Path:
    """train.py, and requirements.txt naming a wheel of the project's own."""
    user_script.write_project(root, **{"requirements.txt": f"./wheels/{TINYDEP}\n"})
    (root / "wheels").mkdir()
    with zipfile.ZipFile(root / "wheels" / TINYDEP, "w") as whl:
        whl.writestr("tinydep.py", "ANSWER = 42\n")
        whl.writestr("tinydep-1.0.dist-info/METADATA",
                     "Metadata-Version: 2.1\nName: tinydep\nVersion: 1.0\n")
        whl.writestr("tinydep-1.0.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                     "Tag: py3-none-any\n")
        whl.writestr("tinydep-1.0.dist-info/RECORD", "")
    return root


def installed(venv: Path) -> dict[str, str]:
    """The environment of a user of the installed `spotring`: nothing of the checkout on
    its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"PATH": f"{venv / 'bin'}:{env['PATH']}"}


def launch(venv: Path, root: Path, runs: Path, *overrides: str, spares: int | None = None,
           script: tuple[str, ...] = ()) -> Followed:
    """`spotring launch cluster=local nodes=2 ... -- python train.py ... SCRIPT` from
    ``root``, a step every 0.25 s; with ``spares``, a pool of that many nodes beyond the
    first 2 (harness/launcher.py)."""
    args = ["launch", "cluster=local", "nodes=2", "cluster.notice_poll_s=1",
            f"runs_dir={runs}", *overrides, "--", "python", "train.py", *STEPS,
            "--sleep", "0.25", *script]
    if spares is None:
        proc = subprocess.Popen([str(venv / "bin" / "spotring"), *args], cwd=root,
                                env=installed(venv), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    else:
        proc = launch_with_spares(spares, *args, python=str(venv / "bin" / "python"), cwd=root,
                                  env=installed(venv))
    return Followed(proc, timeout_s=900)


def launch_with_a_notice(venv: Path, root: Path, runs: Path, *overrides: str
                         ) -> tuple[int, str, RunDir, float]:
    """A launch of 2 nodes with a spot notice for node 1 once training runs, which stays
    up: the launcher replaces node 1 and the job resumes. Returns the exit code, the
    output, the run and when the notice came (benchmarks/results/recovery-local/
    measure.py)."""
    followed = launch(venv, root, runs, "cluster.max_preemptions=1", *overrides)
    run, _, noticed, metadata = notice_node_1(followed, trained=1)
    try:
        code, out = followed.end()
    finally:
        metadata.close()
    return code, out, run, noticed
