"""DeepSpeed's hostfile: one machine per line, `hostname slots=N` (N processes there), `#` comments.

The hostfile is the cluster: its first host is machine rank 0 (the rendezvous address unless
--main-process-ip says otherwise), its line count the number of machines, its slots the processes.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmtune.errors import UserError

# what DeepSpeed's launcher accepts (`^(\S+)\s+slots=(\d+)`, read from the line's start: OpenMPI's
# `max_slots=N` after it is ignored there too); anything looser would pass here and fail there
LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)")
HINT = "write one machine per line as `hostname slots=N`, as DeepSpeed's launcher reads it"


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """[(host, slots)] in file order. Every problem is a UserError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--hostfile {path}: no such file", HINT)
    hosts: list[tuple[str, int]] = []
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise UserError(f"--hostfile {path}: can't read it ({err.strerror})") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = LINE.match(line)
        if not match:
            raise UserError(f"--hostfile {path} line {number}: can't read {raw.strip()!r}", HINT)
        host, slots = match.group("host"), int(match.group("slots"))
        if slots < 1:
            raise UserError(f"--hostfile {path} line {number}: {host} has slots={slots}", "slots is at least 1")
        if host in {h for h, _ in hosts}:
            raise UserError(f"--hostfile {path} line {number}: {host} is listed twice", "list each machine once")
        hosts.append((host, slots))
    if not hosts:
        raise UserError(f"--hostfile {path} lists no machine", HINT)
    counts = {slots for _, slots in hosts}
    if len(counts) > 1:
        listed = ", ".join(f"{h} slots={s}" for h, s in hosts)
        raise UserError(f"--hostfile {path}: machines have different slots ({listed})",
                        "give every machine the same number of processes (the plan's world is machines x slots)")  # fmt: skip
    return hosts
