"""The test harness: what the test files of tests/ share, and what the measurement scripts
of benchmarks/results/ take from them.

Ranks spawned in the test process (ranks.py); emulators: the object stores' (stores.py;
azurite/ is the npm package of Microsoft's Azurite), the clouds' metadata services
(imds.py), moto and a stand-in ssh (aws.py), a SLURM cluster (slurm.py), fault proxies
(faults.py, shard_faults.py); stand-ins for the launcher's providers and the notice
watcher's engine (recovery.py, watcher.py); workloads and users' scripts (workloads.py,
shard_workload.py, user_script.py, fsdp_train.py, deterministic_trainer.py, examples.py,
scaler.py); running the commands as users do (commands.py, launcher.py, local_launch.py,
installed.py, sweeps.py); the cores a session's tests share (cores.py); and the checks of
what runs leave (reports.py, weights.py, schedule.py).

Imported by tests/ and by benchmarks/results/*/; it imports neither (tests/test_layout.py
fails on any import of tests from outside it, its conftest included). Not part of the
installed wheel: pyproject.toml lists the packages that are.
"""

from pathlib import Path

# The checkout this harness is in.
REPO = Path(__file__).resolve().parents[1]
