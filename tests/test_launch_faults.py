"""Fault injection: the AWS calls of a whole `spotring launch`, made to fail one at a time.

harness/faults.py puts a proxy in front of the moto server that fails the chosen call over
real HTTP (an internal error, throttling, a dropped connection), and botocore's real
retries meet it. The launcher runs in this process (launch.__main__.main, as `spotring`
runs it), with AWS_MAX_ATTEMPTS=2: a fault on one attempt passes, an outage fails both.
Its instances are moto's records, so the job fails at its first ssh (harness/aws.py's
stand-in) and `launch` tears everything down: a launch makes every call it can make.

The calls are counted from a clean launch, not written down here. By default a sample
fails, one launch each (points() says which: every call of a launch takes minutes);
SPOTRING_FAULTS=all tries every call with every fault.
"""

from __future__ import annotations

import os

import pytest

from harness.aws import MOTO_CLUSTER, aws_env, stand_in_ssh, start_moto, tagged
from harness.commands import Done, call
from harness.faults import FAULTS, FaultProxy, blips, in_turn, outage
from spotring.exits import EXIT_FAILED
from spotring.launch.__main__ import main

# Standard, not the launcher's adaptive mode: its client-side rate limit would slow the
# calls after a throttled one down, in tests that throttle on purpose.
RETRY = {"AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard"}
EVERY = os.environ.get("SPOTRING_FAULTS") == "all"


@pytest.fixture(scope="module")
def proxy():
    server = start_moto()
    host, port = server.get_host_and_port()
    proxy = FaultProxy(f"http://{host}:{port}")
    yield proxy
    proxy.stop()
    server.stop()


@pytest.fixture(scope="module")
def spotring(proxy, tmp_path_factory):
    """spotring COMMAND ARGS... in this process (harness/commands.py), against the proxy,
    with its runs in a temporary directory."""
    home = tmp_path_factory.mktemp("spotring")

    def _spotring(command: str, *overrides: str) -> Done:
        return call(main, command, f"runs_dir={home / 'runs'}", *MOTO_CLUSTER, *overrides)

    with pytest.MonkeyPatch.context() as env:
        for key, value in {**aws_env(proxy.endpoint, home), **RETRY}.items():
            env.setenv(key, value)
        env.setenv("PATH", f"{stand_in_ssh(home / 'bin')}:{os.environ['PATH']}")
        yield _spotring


def launch(spotring, run_id: str) -> Done:
    # A stub for the job's command: it never starts (the stand-in ssh fails first), and
    # the trainer's would have its config composed and checked at every launch.
    return spotring("launch", "nodes=1", "cluster.instance_types=[c5.large]", f"run_id={run_id}",
                    "--", "true")


@pytest.fixture(scope="module")
def calls(spotring, proxy) -> list[str]:
    """The calls of a launch that nothing disturbs, as the proxy counted them."""
    proxy.reset()
    clean = launch(spotring, "clean")
    calls = list(proxy.calls)
    assert clean.code == 1 and "no machine behind this moto instance" in clean.err, clean
    assert "down: done; nothing of run clean is left" in clean.out
    proxy.reset()
    assert tagged("clean") == {}
    return calls


def test_faults_that_pass_are_retried(spotring, proxy, calls):
    """A fault of each kind, on a call early, midway and late in the launch (every call
    under SPOTRING_FAULTS=all), passes on the retry: the launch goes as without it."""
    blipped = ({n: in_turn(n) for n in range(1, len(calls) + 1)} if EVERY else
               {len(calls) * i // 4: fault for i, fault in enumerate(FAULTS, 1)})
    proxy.reset(blips(blipped.get))
    blips_run = launch(spotring, "blips")
    # The same calls, and the same end as the clean launch: nothing was left to `down`.
    assert proxy.calls == calls
    assert len(proxy.failed) == len(blipped)
    assert blips_run.code == 1 and "no machine behind this moto instance" in blips_run.err
    assert "down: done; nothing of run blips is left" in blips_run.out
    proxy.reset()
    assert tagged("blips") == {}


def points(calls: list[str]) -> list[tuple[int, str]]:
    """(call, fault) to try, the faults taking turns: under SPOTRING_FAULTS=all every
    call with every fault; else the first call (a look-up before anything exists), the
    first and the last creation, the first call of each kind of deletion, and the last
    call (the look-up after the teardown)."""
    if EVERY:
        return [(n, fault) for n in range(1, len(calls) + 1) for fault in FAULTS]
    firsts = [calls.index(c) + 1 for c in dict.fromkeys(calls)]
    verb = [c.split(":")[1] for c in calls]
    changes = [n for n in firsts if not verb[n - 1].startswith(("Describe", "Get"))]
    deletions = [n for n in changes if verb[n - 1].startswith(("Delete", "Terminate"))]
    creations = [n for n in changes if n < deletions[0]]
    chosen = {1, creations[0], creations[-1], *deletions, len(calls)}
    return [(n, in_turn(i)) for i, n in enumerate(sorted(chosen))]


@pytest.mark.slow(cores=1)
def test_an_outage_of_any_call_leaves_nothing_that_down_cannot_remove(spotring, proxy, calls):
    """After each: a non-zero exit and a line that says why; and what is left, if
    anything, named with the command that removes it, which then does."""
    problems, left_behind, tried = [], [], points(calls)
    for n, fault in tried:
        run_id = f"fault-{n}-{fault}"
        what = f"call {n} ({calls[n - 1]}) {fault}"
        proxy.reset(outage(n, fault))
        done = launch(spotring, run_id)
        code, err = done.code, done.err
        attempts = len(proxy.failed)
        proxy.reset()
        left = tagged(run_id)
        if attempts != int(RETRY["AWS_MAX_ATTEMPTS"]):
            problems.append(f"{what}: {attempts} attempts failed")
        # An outage is a failure (1), never bad input (2): the same command may pass later.
        if code != EXIT_FAILED or not err.startswith("spotring launch: failed: "):
            problems.append(f"{what}: exit code {code}, stderr {err!r}")
        if left or "still there" in err:
            left_behind.append(f"{what}: {left}")
            named = [i for ids in left.values() for i in ids] + [f"spotring down run_id={run_id}"]
            problems += [f"{what}: {i} not named: {err!r}" for i in named if i not in err]
            again = spotring("down", f"run_id={run_id}")
            if again.code != 0 or tagged(run_id):
                problems.append(f"{what}: `down` again exits {again.code} and leaves "
                                f"{tagged(run_id)}: {again}")
    print(f"{len(tried)} faults tried; left something behind: {len(left_behind)}",
          *left_behind, sep="\n")
    assert problems == []
