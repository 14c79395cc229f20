"""Before DeepSpeed's launcher starts the machines over ssh (pdsh): every machine must answer, without a password.

DeepSpeed itself checks only the first host, and a host that asks for a password or doesn't resolve otherwise
shows up as a pdsh line in the middle of the run's output. llmtune asks each host with the options pdsh will
use (PDSH_SSH_ARGS_APPEND) and names the first that fails.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

from llmtune.errors import UserError

HINT = "set up passwordless ssh from this machine to every host (DeepSpeed's launcher starts them with pdsh), or start "
HINT += "each machine yourself with --no-ssh --machine-rank N"


def ssh_command(host: str) -> list[str]:
    try:
        extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    except ValueError as err:
        raise UserError(f"PDSH_SSH_ARGS_APPEND can't be split into ssh options: {err}", "check its quotes") from None
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *extra, host, "true"]


def check_ssh_hosts(hosts: tuple[str, ...], log=print) -> None:
    for tool in ("pdsh", "ssh"):
        if shutil.which(tool) is None:
            raise UserError(f"{tool} is not installed on this machine; DeepSpeed's launcher needs it to start the others",
                            f"install {'pdsh' if tool == 'pdsh' else 'openssh-client'}, or use --no-ssh")  # fmt: skip
    for rank, host in enumerate(hosts):
        try:
            done = subprocess.run(
                ssh_command(host), capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise UserError(f"machine rank {rank} ({host}) did not answer over ssh within 30 s", HINT) from None
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"ssh exited with {done.returncode}"])[-1]
            raise UserError(f"machine rank {rank} ({host}) is not reachable over ssh: {why}", HINT)
    log(f"ssh reaches all {len(hosts)} machines: {', '.join(hosts)}")
