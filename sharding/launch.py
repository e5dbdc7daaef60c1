"""Multi-host start-up: `jax.distributed.initialize` from flags or environment, then one global mesh.

Every process runs the same program; after `initialize`, `jax.devices()` lists the devices of all hosts and
`make_mesh` lays the global mesh over them. Flags win over the environment:

    --coordinator HOST:PORT   HYBRID_JAX_COORDINATOR   (process 0's address)
    --num-processes N         HYBRID_JAX_NUM_PROCESSES
    --process-id I            HYBRID_JAX_PROCESS_ID
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import jax

ENV = {"coordinator": "HYBRID_JAX_COORDINATOR", "num_processes": "HYBRID_JAX_NUM_PROCESSES",
       "process_id": "HYBRID_JAX_PROCESS_ID"}  # fmt: skip


@dataclass(frozen=True)
class DistributedSpec:
    coordinator: str
    num_processes: int
    process_id: int

    def __post_init__(self):
        if ":" not in self.coordinator:
            raise ValueError(f"coordinator={self.coordinator!r}: expected HOST:PORT")
        if self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes}: must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id}: must lie in [0, num_processes={self.num_processes})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", default=None, help=f"HOST:PORT of process 0 (env {ENV['coordinator']})")
    parser.add_argument("--num-processes", type=int, default=None, help=f"(env {ENV['num_processes']})")
    parser.add_argument("--process-id", type=int, default=None, help=f"(env {ENV['process_id']})")


def spec_from(args: argparse.Namespace | None = None, environ=os.environ) -> DistributedSpec | None:
    """The distributed setup from flags, else environment; None when neither names a coordinator."""

    def pick(name):
        flag = getattr(args, name, None) if args is not None else None
        return flag if flag is not None else environ.get(ENV[name])

    coordinator = pick("coordinator")
    if coordinator is None:
        return None
    missing = [n for n in ("num_processes", "process_id") if pick(n) is None]
    if missing:
        raise ValueError(
            f"coordinator {coordinator!r} given but {missing} missing (flags or {[ENV[m] for m in missing]})"
        )
    return DistributedSpec(str(coordinator), int(pick("num_processes")), int(pick("process_id")))


def initialize(spec: DistributedSpec | None) -> None:
    """Join the multi-process job (a no-op for None: a single process). On CPU the cross-process
    collectives go through gloo."""
    if spec is None:
        return
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator, num_processes=spec.num_processes, process_id=spec.process_id
    )


def barrier(name: str, timeout_s: float = 1800.0) -> None:
    """Wait until every process reaches `name` (a no-op in one process).

    The wait goes through the coordination service, not through a device collective: the first collective
    of a program sets up the cross-process communicator with a short fixed deadline (gloo on CPU: 30 s), so
    a process that finishes compiling much earlier than another must wait here, before running.
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the coordination client; jax has no public barrier that avoids collectives

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(f"barrier({name!r}): {jax.process_count()} processes but no distributed client")
    client.wait_at_barrier(f"hybrid_jax:{name}", timeout_in_ms=int(timeout_s * 1000))
