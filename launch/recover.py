"""`launch` on spot nodes: run the job, and when nodes are taken away, get nodes again
and resume, by the one restart policy of spotring.exits (``verdict``; what each exit
code does: docs/exit-codes.md), within two budgets counted apart:

    cluster.max_preemptions   restarts after a preemption (exit 75: a spot notice or
                              SIGTERM reached the job, which saved a checkpoint)
    cluster.max_restarts      restarts after any other stop the policy runs again (a
                              lost rank, a crash, a node gone or unreachable by ssh); not
                              after a failure that repeats where it happened (the same
                              exit at the same step as the try before, no node lost)

Before each restart the lost nodes are found: those no longer `running` (or gone from the
provider's list), and those whose metadata service announces a spot interruption notice
(launch/notice.py), doomed whatever their state; after a preemption with neither, the
launcher waits up to cluster.notice_wait_s for one. The lost nodes are taken down and
replaced (on EC2: the same type, else the next of cluster.instance_types, in the run's
zone); if none can be had, the job goes on with the survivors, where they are at least
cluster.min_nodes and the job can run on them.

The job's command is pinned once, at the first start (spotring.cli.pin_command: the
trainer writes its global batch on that many workers into its overrides), and every
restart runs the same pinned command: on fewer (or again more) workers the job splits
the same global batch, and with the world-size-invariant sample order it continues the
same sample sequence with the same steps (docs/design.md). At the start the launcher says
on which node counts the job can go on (spotring.cli.check_command). A command resumes
from its newest checkpoint (the trainer's resume=auto, or a script's job.restore());
every rank keeps its part of each checkpoint on its node, and if a node is lost only
checkpoint.uri=s3://, gs:// or az://... (the job's SPOTRING_CHECKPOINT_URI) keeps them.

Each try is recorded in state.json ("tries": when it ran, on which nodes, how it ended,
the step it reached and resumed from, the job's notice and checkpoint times), which
launch/ledger.py turns into the run's bill; the run's end says how much of each budget
it spent.
"""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig

from spotring.cli import check_command, pin_command
from spotring.exits import EXIT_FAILED, EXIT_OK, ConfigError
from spotring.launch import in_place, notice, tries
from spotring.launch.provider import NoCapacity, Node, Provider
from spotring.launch.run import run as run_job
from spotring.launch.run import ssh_for
from spotring.launch.rundir import RunDir
from spotring.launch.ssh import RemoteError
from spotring.launch.up import admit
from spotring.polling import poll
from spotring.support.restarts import MAX_PREEMPTIONS, MAX_RESTARTS, Launcher, Verdict

log = logging.getLogger("launch")

# How `spotring launch` applies the restart policy (docs/exit-codes.md).
POLICY = Launcher("spotring launch", {MAX_PREEMPTIONS: "cluster.max_preemptions",
                                      MAX_RESTARTS: "cluster.max_restarts"}, sees_steps=True)
# The cause of a restart, as tries and the ledger record it, by the budget it spends.
CAUSES = {MAX_PREEMPTIONS: "preemption", MAX_RESTARTS: "failure"}


def supervise(cfg: DictConfig, run: RunDir, provider: Provider) -> int:
    """Run the job on the run's nodes until it ends; replace lost nodes between tries.
    Returns the last try's exit code; the last line logged says what each budget spent.
    ConfigError where the job cannot start on the nodes it got (its global batch, say)."""
    nodes = run.nodes()
    cfg.job.command = pin_command(list(cfg.job.command), _workers(nodes))
    _say_node_counts(cfg, nodes)
    c = cfg.cluster
    if (c.max_restarts or c.max_preemptions) and not cfg.checkpoint.uri:
        log.info("recover: unless the job keeps its checkpoints elsewhere itself, each "
                 "rank's part stays on its node: should a node be lost, the job starts over. "
                 "checkpoint.uri=s3://, gs:// or az://bucket/prefix keeps them in a store "
                 "too")
    budgets = {MAX_PREEMPTIONS: c.max_preemptions, MAX_RESTARTS: c.max_restarts}
    spent = dict.fromkeys(budgets, 0)
    try:
        while True:
            nodes = run.nodes()
            started = time.time()
            try:
                code, unreachable = (in_place.run(
                    cfg, run, provider, lambda lost: _replace(cfg, run, provider, lost),
                    lambda cause: _spend(cause, spent, budgets))
                    if cfg.job.launcher == "in_place" else run_job(cfg, run, provider)), None
            except RemoteError as e:  # ssh to a node failed: lost, or a failure of its own
                code, unreachable = None, e
            outcome = tries.outcome(run, started, [n.id for n in nodes], code)
            # ssh failing is a failure; whether a node explains it is told below.
            answer = POLICY.verdict(EXIT_FAILED if code is None else code)
            stop, lost = _out_of_budget(answer, spent, budgets), []
            if stop is None and answer.budget is not None:
                lost = _lost_nodes(cfg, run, provider,
                                   waiting=answer.budget == MAX_PREEMPTIONS)
                if not lost:  # nothing the machines did explains it
                    stop = _unexplained(code, outcome, run.tries())
            restart = None if stop or answer.budget is None else CAUSES[answer.budget]
            tries.record(run, outcome, restart, [n.id for n in lost])
            if code == EXIT_OK:
                return code
            if restart is None:
                log.info("recover: %s: %s; stopping", _ended(code, outcome, unreachable), stop)
                if code is None:
                    raise unreachable
                return code
            spent[answer.budget] += 1
            log.info("recover: %s %d of %d (%s): %s, lost %s", restart, spent[answer.budget],
                     budgets[answer.budget], POLICY.budgets[answer.budget],
                     _ended(code, outcome, unreachable),
                     ", ".join(n.id for n in lost) or "no node (every node still runs)")
            _replace(cfg, run, provider, lost)
    finally:
        log.info("recover: the run spent %s", ", ".join(
            f"{spent[b]} of {budgets[b]} {CAUSES[b]}s ({POLICY.budgets[b]})" for b in budgets))


def _spend(cause: str, spent: dict[str, int], budgets: dict[str, int]) -> bool:
    """In place: one more of ``cause``'s (a CAUSES value) replacements or restarts, where
    its budget allows; the job trains on meanwhile."""
    budget = next(b for b, c in CAUSES.items() if c == cause)
    if spent[budget] >= budgets[budget]:
        log.info("recover: no %ss left (%d of %s=%d spent): nothing is replaced", cause,
                 spent[budget], POLICY.budgets[budget], budgets[budget])
        return False
    spent[budget] += 1
    return True


def _workers(nodes: list[Node]) -> int:
    return sum(n.slots for n in nodes)


def _why_not_on(command: list[str], workers: int) -> str | None:
    """Why the job cannot run on ``workers`` workers, as its command says
    (spotring.cli.check_command); None where it can, or says nothing of it."""
    try:
        check_command(command, [workers])
    except ConfigError as e:
        return str(e)
    return None


def _say_node_counts(cfg: DictConfig, nodes: list[Node]) -> None:
    """Log on which node counts, down to cluster.min_nodes, the job can go on when no
    replacement can be had; ConfigError where it cannot start on ``nodes`` at all."""
    command, slots = list(cfg.job.command), nodes[0].slots
    if (why := _why_not_on(command, _workers(nodes))) is not None:
        raise ConfigError(f"the job cannot run on the {len(nodes)} nodes it got "
                          f"({_workers(nodes)} workers): {why}")
    fewer = range(len(nodes) - 1, cfg.cluster.min_nodes - 1, -1)
    refused = {n: why for n in fewer if (why := _why_not_on(command, n * slots)) is not None}
    can = [str(n) for n in fewer if n not in refused]
    said = (f"with no replacement to be had it can go on with {' or '.join(can) or 'no fewer'}"
            f" nodes (cluster.min_nodes={cfg.cluster.min_nodes})")
    if refused:
        first = next(iter(refused))
        said += (f"; not with {' or '.join(map(str, refused))}, which the job refuses (on "
                 f"{first}: {refused[first]})")
    log.info("recover: the job runs on %d nodes, %d workers; %s", len(nodes),
             _workers(nodes), said)


def _out_of_budget(answer: Verdict, spent: dict[str, int],
                   budgets: dict[str, int]) -> str | None:
    """Why the run stops after this try, whatever it lost (None: the policy runs it again
    and the budget allows, or the job is done)."""
    if answer.budget is None:
        return answer.why
    if spent[answer.budget] >= budgets[answer.budget]:
        return (f"no {CAUSES[answer.budget]}s left ({spent[answer.budget]} of "
                f"{POLICY.budgets[answer.budget]}={budgets[answer.budget]} spent)")
    return None


def _unexplained(code: int | None, outcome: dict, before: list[dict]) -> str | None:
    """Why a stop that lost no node ends the run: ssh failed to a node that runs, or the
    policy refuses a repeat of the try before (the same exit at the same step)."""
    if code is None:
        return "ssh failed to a node that still runs"
    last = before[-1] if before else None
    repeated = last is not None and (last["exit"], last["step"]) == (code, outcome["step"])
    answer = POLICY.verdict(code, repeated)
    return None if answer.budget is not None else answer.why


def _ended(code: int | None, outcome: dict, unreachable: RemoteError | None) -> str:
    how = f"exit {code}" if code is not None else f"ssh failed ({unreachable})"
    step = f" at step {outcome['step']}" if outcome["step"] is not None else ""
    why = f" ({outcome['reason']})" if outcome.get("reason") else ""
    return how + why + step


def _lost_nodes(cfg: DictConfig, run: RunDir, provider: Provider,
                waiting: bool) -> list[Node]:
    """The run's nodes that are lost: not `running`, gone from the provider's list
    altogether (EC2 stops listing terminated instances after a while), or announcing a
    spot interruption notice (doomed: launch/notice.py). After a preemption (``waiting``)
    with none of them, up to cluster.notice_wait_s for one (a notice of EC2's that the
    job saw before the node's own service shows it, or SIGTERM when EC2 takes it)."""
    ssh = ssh_for(cfg, run)

    def lost() -> list[Node] | None:
        running = {n.id for n in provider.describe() if n.state == "running"}
        noticed = notice.noticed(ssh, [n for n in run.nodes() if n.id in running],
                                 provider.workdir)
        for node in run.nodes():
            if node.id in noticed:
                log.info("recover: node %s announces a spot interruption notice (%s): it "
                         "is doomed, and is taken down", node.id, noticed[node.id])
        return [n for n in run.nodes() if n.id not in running or n.id in noticed] or None

    try:
        return poll(lost, timeout_s=cfg.cluster.notice_wait_s if waiting else 0,
                    interval_s=cfg.cluster.notice_poll_s, what="a lost node")
    except TimeoutError:  # every node still runs: the restart goes on with them all
        return []


def _replace(cfg: DictConfig, run: RunDir, provider: Provider, lost: list[Node]) -> list[Node]:
    """The nodes to restart on: the survivors and replacements for the lost, or the
    survivors alone when no replacement can be had, they are at least cluster.min_nodes
    and the job can run on them. The lost nodes leave the bill now, when they were found
    lost, not once their replacements run."""
    found_at = time.time()
    gone = {n.id for n in lost}
    survivors = [n for n in run.nodes() if n.id not in gone]
    if not lost:
        return survivors
    if run.nodes()[0].id in gone:
        log.info("recover: node 0 was lost, and with it the checkpoints on its disk; the "
                 "job resumes from its checkpoint URI if it has one, else from the start")
    try:
        new = provider.replace(lost)  # takes the lost nodes down first
    except NoCapacity as e:
        why = (f"{len(survivors)} left is below cluster.min_nodes={cfg.cluster.min_nodes}"
               if len(survivors) < cfg.cluster.min_nodes
               else _why_not_on(list(cfg.job.command), _workers(survivors)))
        if why is not None:
            raise NoCapacity(f"no replacement for {len(lost)} lost node(s), and {why}: "
                             f"{e}") from e
        log.info("recover: no replacement to be had (%s); going on with %d node(s), %d "
                 "workers (cluster.min_nodes=%d)", e, len(survivors), _workers(survivors),
                 cfg.cluster.min_nodes)
        new = []
    run.retire(lost, at=found_at)
    nodes = survivors + new
    admit(cfg, run, nodes, new)
    return nodes
