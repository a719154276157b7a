"""Start ``mg train`` on several processes with PyTorch's elastic launcher, or join one.

``mg train --nproc-per-node N`` re-executes itself under ``python -m torch.distributed.run``;
a process that is already a worker (started by ``torchrun``, by ``mg`` itself, or by Slurm's
``srun``) just runs. We never implement our own launcher or rendezvous.
"""

from __future__ import annotations

import os
import subprocess
import sys


def under_launcher() -> bool:
    """True when this process is already one rank of a launched job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_slurm_env() -> bool:
    """Map Slurm's task variables onto torch.distributed's when started by ``srun`` directly.

    MASTER_ADDR/MASTER_PORT must be exported by the batch script (e.g. the first host of
    ``scontrol show hostnames $SLURM_JOB_NODELIST``). Returns True when Slurm variables were used.
    """
    if under_launcher() or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return False
    if int(os.environ["SLURM_NTASKS"]) <= 1:
        return False
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        raise SystemExit(
            "error: started by srun without MASTER_ADDR; export MASTER_ADDR (first node's host) in the batch script"
        )
    return True


def relaunch(
    argv: list[str], *, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None
) -> int:
    """Run ``mg <argv>`` on ``nproc_per_node`` local processes (x ``nnodes``) via torch.distributed.run.

    Returns the launcher's exit code: non-zero when any rank failed (the launcher stops the rest).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", "--max-restarts=0"]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr or '127.0.0.1'}",
            f"--master-port={master_port or 29500}",
        ]
    cmd += ["-m", "mg_cli.main", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # The launcher forwards SIGTERM/SIGINT to the workers, which save and exit cleanly.
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()
