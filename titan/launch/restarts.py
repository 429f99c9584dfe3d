"""Restarts inside the job: torchrun's elastic restarts (``--max-restarts N``), minus the ones that
cannot help.

torchrun restarts the whole worker group whenever a worker fails, whatever the reason. A titan
user error (exit status 2: a bad dataset path, a damaged checkpoint, a setting the model rejects)
fails again on every attempt, and a run the launcher was asked to stop (SIGTERM / SIGUSR1 /
SIGINT) must stop. So the launcher runs torchrun's own agent with one decision added where the
agent looks at its workers: on such a failure it spends the rest of the restart budget at once
(the agent then stops the ranks and returns, exactly as when the budget is used up), the same
switch torchrun itself flips for a worker stuck in the kernel. Everything else (rendezvous, the
stop of the surviving ranks, the new worker group, multi-node agreement) stays torchrun's.

Before each restart the cause goes to the ranks of the next attempt (``TITAN_RESTART_CAUSE``), so
the run's goodput record names why the previous attempt ended even when its rank 0 was killed,
with when the failed rank's process ended and when this launcher noticed (its recovery's parts).
The new ranks are warm standbys where possible (titan.launch.standby).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from titan.launch.report import USER_ERROR_STATUS
from titan.launch.standby import StandbyPool, rank_process, standbys_per_rank
from titan.training.goodput import DETECTED_AT_ENV, FAILED_AT_ENV, RESTART_CAUSE_ENV

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

# torchrun's failures of one attempt, by global rank
Failures = dict[int, "ProcessFailure"]


class RestartPolicy:
    """Decides, per failed attempt, whether torchrun may restart the ranks. ``explain`` turns
    torchrun's failures (by global rank) into (titan's one line, exit status); ``stopping``
    says whether the launcher was asked to stop."""

    def __init__(
        self,
        max_restarts: int,
        explain: Callable[[Failures], tuple[str, int]],
        stopping: Callable[[], bool],
        context: Callable[[Failures], list[str]] | None = None,
    ) -> None:
        self.max_restarts = max_restarts
        self.explain = explain
        self.stopping = stopping
        self.context = context  # lines printed once per failed attempt, before its cause
        self.restarts = 0
        self.last_cause: str | None = None
        # global rank -> stderr file of a rank whose output the console did not show (torchrun's
        # --local-ranks-filter), for the failed attempt being explained
        self.hidden_outputs: dict[int, str] = {}

    def on_failure(self, failures: Failures, remaining: int, failed_at: float = 0.0, detected_at: float = 0.0) -> int:
        """Called with a failed attempt's failures and the restarts left (and when its first failed
        process ended and when the agent saw it); returns the restarts the agent may still do (0:
        end the job with this failure)."""
        for line in self.context(failures) if self.context else []:
            print(line, file=sys.stderr, flush=True)
        line, status = self.explain(failures)
        self.last_cause = line
        if remaining <= 0:
            return 0
        if status == USER_ERROR_STATUS:
            print(
                "titan launcher: not restarting after a titan error (it would fail again on every attempt)",
                file=sys.stderr,
                flush=True,
            )
            return 0
        if self.stopping():
            return 0
        self.restarts += 1
        print(
            f"titan launcher: {line}; restarting the ranks (restart {self.restarts} of {self.max_restarts});"
            " they resume from the newest intact checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os.environ[RESTART_CAUSE_ENV] = line  # the next ranks' environment is a copy of ours
        now = time.time()
        os.environ[DETECTED_AT_ENV] = repr(detected_at or now)
        # every failure so far (the last ones): a recovery may span restarts that failed again
        ended = [t for t in os.environ.get(FAILED_AT_ENV, "").split(",") if t][-49:]
        os.environ[FAILED_AT_ENV] = ",".join([*ended, repr(min(failed_at or now, detected_at or now))])
        return remaining

    def final_line(self, line: str) -> str:
        """The job's last line once the budget is spent: the last cause, and that restarts ran out."""
        if self.max_restarts > 0 and self.restarts >= self.max_restarts:
            return f"{line} (gave up after {self.restarts} restart(s): --max-restarts {self.max_restarts})"
        return line


def _hidden_outputs(pcontext: object, failures: Failures) -> dict[int, str]:
    """Global rank -> its stderr file, for the failed ranks whose stderr went to a file (torchrun's
    --tee / --redirects) but not to the console (--local-ranks-filter left them out)."""
    files = getattr(pcontext, "stderrs", None) or {}
    shown = getattr(pcontext, "tee_stderrs", None) or {}
    out = {}
    for rank, f in failures.items():
        path = files.get(f.local_rank, "")
        if path and path != os.devnull and f.local_rank not in shown:
            out[rank] = path
    return out


def _one_node(handler: object) -> bool:
    """Whether torchrun's rendezvous can only ever hold this one node (``--nnodes 1``)."""
    return getattr(getattr(handler, "_settings", None), "max_nodes", None) == 1


def _agent_class(policy: RestartPolicy) -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.utils.distributed import get_free_port

    class TitanAgent(LocalElasticAgent):
        def _rendezvous(self, worker_group):  # type: ignore[override]
            # A job of one node restarts with the same ranks: a new rendezvous round would only
            # cost time (torchrun's polls its store once a second). The new ranks' process group
            # gets a new port.
            if policy.restarts and worker_group.workers and _one_node(worker_group.spec.rdzv_handler):
                worker_group.master_port = get_free_port()
                return None
            return super()._rendezvous(worker_group)  # type: ignore[call-arg]

        def _monitor_workers(self, worker_group):  # type: ignore[override]  # torchrun's, wrapped by its @prof
            polled = time.time()  # torchrun polls first, then stops the other ranks of a failed attempt
            result = super()._monitor_workers(worker_group)  # type: ignore[call-arg]
            if result.is_failed():
                policy.hidden_outputs = _hidden_outputs(self._pcontext, result.failures)
                handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
                ended = [getattr(handlers.get(f.local_rank), "titan_exited_at", None) for f in result.failures.values()]
                failed_at = min((t for t in ended if t), default=polled)
                self._remaining_restarts = policy.on_failure(
                    result.failures, self._remaining_restarts, failed_at, polled
                )
            return result

    return TitanAgent


@contextlib.contextmanager
def policy_installed(policy: RestartPolicy, first: StandbyPool | None = None) -> Iterator[None]:
    """torchrun's ``launch_agent`` builds its agent from a name in its own module and takes no
    agent class, and its process context starts each rank through a name in its module; for the
    length of one ``run`` in this (launcher) process those names are ours (the agent with the
    policy; ranks that note when they end and are warm standbys: ``first``'s for the first
    attempt, with restarts new ones for the next)."""
    from torch.distributed.elastic.multiprocessing import api as processes
    from torch.distributed.launcher import api

    original = getattr(api, "LocalElasticAgent")  # noqa: B009 - a name the module uses, not one it exports
    start = getattr(processes, "get_subprocess_handler")  # noqa: B009
    per_rank = standbys_per_rank(policy.max_restarts)
    if first is not None:
        first.per_rank = per_rank
    pool = first if first is not None else StandbyPool(per_rank=per_rank) if per_rank else None
    setattr(api, "LocalElasticAgent", _agent_class(policy))  # noqa: B010
    setattr(processes, "get_subprocess_handler", rank_process(pool, start))  # noqa: B010
    try:
        yield
    finally:
        setattr(api, "LocalElasticAgent", original)  # noqa: B010
        setattr(processes, "get_subprocess_handler", start)  # noqa: B010
        if pool is not None:
            pool.close()
