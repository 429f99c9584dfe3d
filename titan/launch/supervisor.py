"""``python -m titan.launch [torchrun options] train.py [titan options]``: torchrun, with what a
scheduler and a user at a terminal need from it.

- The merged config is checked first, in this one process (titan.launch.check): a bad key or file
  ends with titan's line and exit status 2 before any rank starts.
- SIGTERM, SIGINT and SIGUSR1 to the launcher go straight to the ranks (torchrun starts each in its
  own session, so nothing else reaches them), as SIGTERM for SIGINT: every rank finishes its step,
  saves a checkpoint and exits 0, torchrun sees a successful run and the launcher exits 0. A second
  SIGINT kills the ranks. (torchrun's own handling would wait for the save too, but then always
  exits 1 with a traceback, which a scheduler records as a failure.)
- When ranks fail, torchrun's ChildFailedError traceback is replaced by one line, printed last: the
  root cause rank's own titan line (from its error file; the ranks leave printing it to this
  launcher, so it appears once) or what happened to it, and the exit status is that rank's (2 for a
  user error). A rank whose output the console did not show (--local-ranks-filter, run_train.sh's
  LOG_RANK) gets its last error lines shown from torchrun's --tee file (titan.launch.causes); a
  SIGKILL is called out of memory only when the kernel counted an OOM kill in the job's cgroup.
- The ranks learn this process's pid (TITAN_LAUNCHER_PID) and stop if it dies (titan.launch.parent).
- With ``--max-restarts N`` a failed attempt is restarted by torchrun (the ranks resume from the
  newest checkpoint), except after a titan user error or a signal to the launcher
  (titan.launch.restarts); once the budget is spent the last cause is the last line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from argparse import Namespace
from types import FrameType, MappingProxyType
from typing import TYPE_CHECKING

from titan.launch.causes import error_tail, oom_kill_count, sigkill_phrase
from titan.launch.check import WORLD_SIZE, wants_help
from titan.launch.check import main as check_config
from titan.launch.parent import LAUNCHER_PID_ENV
from titan.launch.report import PEER_LOST_PHRASE, PEER_LOST_STATUS, USER_ERROR_STATUS
from titan.launch.restarts import Failures, RestartPolicy, policy_installed
from titan.launch.standby import StandbyPool, first_ranks, is_rank
from titan.training.checks import CHECKED_ENV

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

# signal to the launcher -> signal to the ranks (titan's ranks save and stop on SIGTERM / SIGUSR1)
FORWARD = MappingProxyType(
    {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGTERM, signal.SIGUSR1: signal.SIGUSR1}
)


def child_pids(pid: int) -> list[int]:
    """Live children of ``pid`` (the ranks: torchrun's agent runs in this process), without the
    warm standbys that are no rank yet (titan.launch.standby.is_rank)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, rest = f.read().split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()
        except (OSError, IndexError, ValueError):
            continue
        if fields[0] != "Z" and int(fields[1]) == pid and is_rank(int(entry), comm):
            out.append(int(entry))
    return out


class Forwarder:
    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> None:
        for sig in FORWARD:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        name = signal.Signals(signum).name
        ranks = child_pids(os.getpid())
        self.received.append(signum)
        if not ranks:  # still in rendezvous, or the ranks have exited: torchrun shuts down
            raise SignalException(f"launcher got {name}", sigval=signal.Signals(signum))
        if signum == signal.SIGINT and self.received.count(signal.SIGINT) > 1:
            print(f"titan launcher: {name} again: killing the {len(ranks)} ranks", file=sys.stderr, flush=True)
            forward = signal.SIGKILL
        else:
            forward = FORWARD[signal.Signals(signum)]
            print(
                f"titan launcher: {name}: asking the {len(ranks)} ranks to save a checkpoint and stop"
                f" (sent {forward.name})",
                file=sys.stderr,
                flush=True,
            )
        for pid in ranks:
            try:
                os.kill(pid, forward)
            except ProcessLookupError:
                pass


def titan_args(argv: list[str]) -> list[str] | None:
    """The arguments after titan's entry point (train.py or -m titan.train), found without
    torchrun's parser so that a bad config fails before torch is imported; None for other scripts.
    The script is the first argument ending in .py, or the one after -m."""
    for i, arg in enumerate(argv):
        if i and argv[i - 1] in ("-m", "--module"):
            return argv[i + 1 :] if arg == "titan.train" else None
        if arg.endswith(".py"):
            return argv[i + 1 :] if os.path.basename(arg) == "train.py" else None
    return None


def failure_line(
    failures: Failures,
    received: list[int],
    hidden: dict[int, str] | None = None,
    oom_kills: tuple[int | None, int | None] = (None, None),
) -> tuple[str, int]:
    """One line for the root cause among failed ranks (torchrun's ProcessFailure by global rank),
    and the exit status to end with. A rank that reported "another rank failed" is a consequence;
    a rank's own titan line (from its error file) is preferred, then the earliest failure. A rank
    that wrote its line but was stopped by torchrun (another rank failed first) before it exited
    still reports its line: that is why it was failing. ``hidden``: the stderr files of failed
    ranks the console did not show (their last error line goes into this line); ``oom_kills``: the
    kernel's OOM-kill count of this job's cgroup before the run and now."""

    def titan_line(f: ProcessFailure) -> bool:
        return isinstance(f.message, str) and f.message.startswith("titan: ")

    def peer_lost(f: ProcessFailure) -> bool:  # also when torchrun stopped the rank before it exited 3
        return f.exitcode == PEER_LOST_STATUS or (titan_line(f) and PEER_LOST_PHRASE in f.message)

    def rank_order(item: tuple[int, ProcessFailure]) -> tuple:
        rank, f = item
        # torchrun's SIGTERM to the survivors is a consequence too
        return (peer_lost(f), not titan_line(f), f.exitcode == -signal.SIGTERM, f.exitcode < 0, f.timestamp, rank)

    rank, f = min(failures.items(), key=rank_order)
    if titan_line(f):
        return f.message, f.exitcode if f.exitcode > 0 else PEER_LOST_STATUS if peer_lost(f) else USER_ERROR_STATUS
    if f.exitcode < 0:
        sig = f.signal_name()
        if received and -f.exitcode == FORWARD.get(signal.Signals(received[0]), received[0]):
            return (
                f"titan: stopped by {signal.Signals(received[0]).name} while the ranks were starting"
                " (nothing to save yet)",
                128 - f.exitcode,
            )
        why = f"; {sigkill_phrase(*oom_kills)}" if -f.exitcode == signal.SIGKILL else ""
        return (
            f"titan: error: rank {rank} (pid {f.pid}) was killed by {sig}; the other ranks stopped with it{why}",
            128 - f.exitcode,
        )
    tail = error_tail(hidden[rank]) if hidden and rank in hidden else []
    if tail:
        return (
            f"titan: error: rank {rank} exited with status {f.exitcode}: {tail[-1].strip()} (its output is not on"
            " the console, see LOG_RANK / --local-ranks-filter; its last lines are above)",
            f.exitcode,
        )
    return f"titan: error: rank {rank} exited with status {f.exitcode}; its output above says why", f.exitcode


def hidden_context(failures: Failures, hidden: dict[int, str]) -> list[str]:
    """The last error lines (all but the exception line, which ends failure_line's line) of each
    failed rank without a titan line whose output the console did not show, as torchrun prefixes
    a rank's lines."""
    out = []
    for rank in sorted(failures):
        f = failures[rank]
        if rank in hidden and f.exitcode > 0 and not (isinstance(f.message, str) and f.message.startswith("titan: ")):
            out += [f"[rank{rank}]: {line}" for line in error_tail(hidden[rank])[:-1]]
    return out


def _end_with(line: str) -> None:
    """The run's cause, printed last; and, for a wrapper that adds output after ours (srun's "task 0:
    Exited with exit code 2"), in a file it can print last (multinode_trainer.slurm sets
    TITAN_LAUNCH_SUMMARY)."""
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TITAN_LAUNCH_SUMMARY")
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")


def _option(argv: list[str], *names: str) -> str | None:
    """The value of torchrun option ``names`` (``--opt V`` or ``--opt=V``) among the launcher's own
    arguments (those before the script), or None."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") or (i and argv[i - 1] in ("-m", "--module")):
            break
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def world_size(argv: list[str]) -> int | None:
    """The ranks torchrun will start (nnodes x nproc_per_node), or None for an elastic node range
    (``--nnodes MIN:MAX``): then the layout is checked by the ranks, once they know their number."""
    nnodes = _option(argv, "--nnodes") or "1"
    low, _, high = nnodes.partition(":")
    if not low.isdigit() or (high and high != low):
        return None
    nproc = _option(argv, "--nproc_per_node", "--nproc-per-node") or "1"
    if not nproc.isdigit():  # auto / gpu / cpu / xpu: torchrun's own count
        from torch.distributed.run import determine_local_world_size

        try:
            return int(low) * determine_local_world_size(nproc)
        except ValueError:
            return None  # torchrun says why
    return int(low) * int(nproc)


def main(argv: list[str]) -> int:
    train_args = titan_args(argv)
    first: StandbyPool | None = None
    if train_args is not None:
        if wants_help(train_args):
            return check_config(train_args)
        size = world_size(argv)
        # The first ranks' interpreters start once the config parses: their imports overlap the
        # check (titan.launch.standby); a failed check stops them.
        first = first_ranks(_option(argv, "--nproc_per_node", "--nproc-per-node"))
        if first is not None:  # the command line the standbys warm up on (the script's name is skipped)
            first.args, first.world_size = ("train.py", *train_args), str(size) if size is not None else ""
        args = train_args + ([WORLD_SIZE, str(size)] if size is not None else [])
        status = check_config(args, first.start if first is not None else None)
        if status:
            if first is not None:
                first.kill()
            return status
        os.environ[CHECKED_ENV] = "1"  # the ranks (a copy of this environment) do not read it all again
    try:
        return _torchrun(argv, first)
    finally:
        if first is not None:
            first.close()  # any no rank took: torchrun refused its own options before starting one


def torchrun_args(argv: list[str]) -> Namespace:
    """torchrun's options; torchrun keeps the signals this launcher does not forward itself
    (SIGHUP, SIGQUIT)."""
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    ours = {s.name for s in FORWARD}
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in ours) or "SIGHUP"
    return args


class _Redundant(logging.Filter):
    """torchrun's per-rank lines about a failed attempt ("failed (exitcode: 1) local_rank: 1 ...",
    "Sending process N closing signal SIGTERM"): the launcher's last line names the failed rank, its
    status or signal and its own words, so these only bury it. Kept with TITAN_DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("failed (exitcode: ") or text.startswith("Sending process "))


def _torchrun(argv: list[str], first: StandbyPool | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.run import run

    args = torchrun_args(argv)
    if not os.environ.get("TITAN_DEBUG"):
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_Redundant())
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if args.max_restarts > 0:
        # The ranks' process group must not share the rendezvous store: a restarted group would read
        # the previous attempt's addresses there and fail to connect.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    forwarder = Forwarder()
    forwarder.install()
    oom_before = oom_kill_count()

    def explain(failures: Failures) -> tuple[str, int]:
        return failure_line(failures, forwarder.received, policy.hidden_outputs, (oom_before, oom_kill_count()))

    policy = RestartPolicy(
        args.max_restarts,
        explain,
        lambda: bool(forwarder.received),
        lambda failures: hidden_context(failures, policy.hidden_outputs),
    )
    try:
        with policy_installed(policy, first):
            run(args)
    except ChildFailedError as e:
        line, status = explain(e.failures)
        _end_with(policy.final_line(line))
        return status
    except SignalException as e:
        print(
            f"titan: stopped by {e.sigval.name} (torchrun sent it to the ranks, if any were running)",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(e.sigval)
    except RendezvousClosedError:
        # Another node's launcher ended the run (a titan error there, or its restarts ran out)
        # while this node was restarting its ranks.
        _end_with(
            policy.final_line(
                "titan: error: the run ended on another node while this one restarted its ranks"
                f" (this node's last failure: {policy.last_cause}); that node's last line says why"
            )
        )
        return 1
    if forwarder.received:
        print(
            f"titan launcher: the ranks stopped cleanly after {signal.Signals(forwarder.received[0]).name}",
            file=sys.stderr,
            flush=True,
        )
    return 0
