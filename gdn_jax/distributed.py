"""Several hosts: one process per host, joined by `jax.distributed`, each running the same engine.

Every process runs the whole engine, the scheduler included, on the same requests: the scheduler is pure and
deterministic, so each process plans the same steps and calls the same step program on the global mesh, and only
the step's collectives cross hosts. No plan is broadcast: a plan is a little Python data that each process derives
itself, where a broadcast would add a round trip between hosts to every step. The requests must therefore reach
every process alike, as an offline script's do (`LLM.generate` over the same prompts, `gdn-jax generate`);
`gdn-jax serve` takes its requests on one process, so it refuses to run on several.
"""

from __future__ import annotations

from gdn_jax import envs


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> tuple[str, int, int] | None:
    """(coordinator address, process count, this process's id) from the arguments, else from
    GDN_JAX_COORDINATOR_ADDRESS, GDN_JAX_NUM_PROCESSES and GDN_JAX_PROCESS_ID; None when no address is given (one
    process). A missing or inconsistent part is a ValueError naming it."""
    address = coordinator_address or envs.get("GDN_JAX_COORDINATOR_ADDRESS") or None
    count = num_processes if num_processes is not None else envs.optional_int("GDN_JAX_NUM_PROCESSES")
    pid = process_id
    if pid is None and (text := envs.get("GDN_JAX_PROCESS_ID")):
        if not text.isdigit():
            raise ValueError(f"GDN_JAX_PROCESS_ID must be a whole number from 0, got {text!r}")
        pid = int(text)
    if address is None:
        if count not in (None, 1) or pid not in (None, 0):
            raise ValueError(f"num_processes={count} and process_id={pid} need a coordinator address "
                             f"(host:port of process 0; GDN_JAX_COORDINATOR_ADDRESS)")
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address must be host:port, got {address!r}")
    if count is None or pid is None:
        raise ValueError("a coordinator address needs the process count and this process's id too "
                         "(num_processes and process_id, or GDN_JAX_NUM_PROCESSES and GDN_JAX_PROCESS_ID)")
    if count < 1 or not 0 <= pid < count:
        raise ValueError(f"process_id must be in [0, num_processes), got process_id={pid}, num_processes={count}")
    return address, count, pid


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Joins this process to the others (`jax.distributed.initialize`; call it before anything runs on a device),
    as `settings` reads them; returns whether it did (False: one process, nothing to join). On the CPU the
    collectives between processes go through gloo."""
    found = settings(coordinator_address, num_processes, process_id)
    if found is None:
        return False
    import jax  # (here: `settings` serves the command line, which starts without JAX)

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=found[0], num_processes=found[1], process_id=found[2])
    return True
