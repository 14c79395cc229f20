"""Before a multi-machine launch, every machine checks in with machine rank 0 on the rendezvous port.

Machine 0 listens, each other machine connects and says its machine rank and what it is about to run
(world size, machines, strategy, global batch). When all have joined with the same plan, machine 0 says
"go", everyone closes, and the real launcher takes the port. So a machine that never comes, a wrong
IP or port, a firewall, a duplicated --machine-rank or machines started with different flags end in
one clear line naming the machine, within `rdzv_timeout`, instead of a hang or a C++ stack trace.

Storage: before it listens, machine 0 writes a fresh token into its output_dir (plan.config_dir); each machine
reads that file in its own output_dir as it checks in. A machine that can't read the token has its own disk. A plan
whose checkpoints need one shared output_dir (plan.shared_output_dir says why) is then stopped here, before any
rank starts, rather than when a resume can't find the other machines' files.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

from llmtune.errors import UserError
from llmtune.launch.net import bind_port

HINT_JOIN = "start `llmtune train` with the same recipe and flags on every machine, each with its own --machine-rank"
HINT_SHARED = ("put output_dir on a filesystem every machine mounts (the same path on each), or set save_only_model: "
               "true (weight snapshots, no resume)")  # fmt: skip
STORAGE_PROBE = "machine-0-token"  # in plan.config_dir: machine 0's token, read by the others as they check in


def _write_probe(plan) -> str:
    """Machine 0: a fresh token in its output_dir, written before anyone can check in (the port isn't open yet)."""
    token = secrets.token_hex(8)
    folder = Path(plan.config_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STORAGE_PROBE).write_text(token)  # rewritten in place: NFS readers revalidate it on open
    return token


def _read_probe(plan) -> str | None:
    """What this machine finds in its own output_dir where machine 0 wrote its token."""
    folder = Path(plan.config_dir)
    try:
        os.listdir(folder)  # refresh a network filesystem's cached view of the folder (a stale "no such file")
        return (folder / STORAGE_PROBE).read_text().strip()
    except OSError:
        return None


def _identity(plan) -> dict:
    return {"world_size": plan.world_size, "num_machines": plan.cluster.num_machines, "strategy": plan.strategy,
            "global_batch_size": plan.global_batch_size}  # fmt: skip


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _read_line(conn: socket.socket, deadline: float) -> dict | None:
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(4096)
        except (TimeoutError, OSError):
            return None
        if not chunk:
            return None
        data += chunk
    try:
        return json.loads(data)
    except ValueError:
        return None


def gather(plan, timeout: float, log=print) -> None:
    """Machine rank 0: wait until every other machine has checked in with a matching plan."""
    cluster = plan.cluster
    expected = set(range(1, cluster.num_machines))
    me = _identity(plan)
    token = _write_probe(plan)
    own_disk: list[int] = []  # machine ranks that don't see machine 0's output_dir
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        bind_port(server, cluster.main_process_port)
    except UserError:
        server.close()
        raise
    server.listen(cluster.num_machines)
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    log(f"waiting for machine(s) {sorted(expected)} on port {cluster.main_process_port} (up to {timeout:.0f} s)")
    try:
        while set(joined) != expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(expected - set(joined))
                raise UserError(f"machine rank(s) {', '.join(map(str, missing))} of {cluster.num_machines} did not join "
                                f"within {timeout:.0f} s (rdzv_timeout) at port {cluster.main_process_port}",
                                f"{HINT_JOIN}; check they reach {cluster.main_process_ip}:{cluster.main_process_port} "
                                "(address, firewall)")  # fmt: skip
            server.settimeout(remaining)
            try:
                conn, address = server.accept()
            except (TimeoutError, OSError):
                continue
            hello = _read_line(conn, min(deadline, time.monotonic() + 30))
            problem = None
            if not hello or "machine_rank" not in hello:
                problem = f"{address[0]} connected to the rendezvous port but is not an llmtune launcher"
            elif hello["machine_rank"] not in expected:
                problem = f"{address[0]} says it is machine rank {hello['machine_rank']}, outside 1..{cluster.num_machines - 1}"
            elif hello["machine_rank"] in joined:
                problem = f"two machines say they are machine rank {hello['machine_rank']}"
            elif hello.get("plan") != me:
                problem = (f"machine rank {hello['machine_rank']} ({address[0]}) plans {hello.get('plan')} but machine 0 "
                           f"plans {me}")  # fmt: skip
            if problem:
                try:
                    _send(conn, {"error": problem})
                finally:
                    conn.close()
                if hello and "machine_rank" in hello and "plan" in hello and hello.get("plan") != me:
                    raise UserError(problem, "start every machine with the same recipe and cluster flags")
                log(f"ignored: {problem}")
                continue
            joined[hello["machine_rank"]] = conn
            shared = hello.get("storage") == token
            if not shared:
                own_disk.append(hello["machine_rank"])
            log(f"machine rank {hello['machine_rank']} joined from {address[0]} "
                f"({'shares this output_dir' if shared else 'its own output_dir: not shared with machine 0'})")  # fmt: skip
        refusal = _storage_refusal(plan, sorted(own_disk))
        for conn in joined.values():
            _send(conn, {"error": refusal, "hint": HINT_SHARED} if refusal else {"go": True})
        for conn in joined.values():  # let the other side close first, so this port is not left in TIME_WAIT
            _read_line(conn, time.monotonic() + 5)
    finally:
        for conn in joined.values():
            conn.close()
        server.close()
    if refusal:
        raise UserError(refusal, HINT_SHARED)


def _storage_refusal(plan, own_disk: list[int]) -> str | None:
    needs = getattr(plan, "shared_output_dir", None)
    if not needs or not own_disk:
        return None
    return (f"{needs} need output_dir on storage every machine shares, but machine rank(s) "
            f"{', '.join(map(str, own_disk))} can't see the file machine 0 just wrote in {plan.config_dir}")  # fmt: skip


def join(plan, timeout: float, log=print) -> None:
    """Machine rank > 0: check in with machine 0 and wait for its go."""
    cluster = plan.cluster
    address = (cluster.main_process_ip, cluster.main_process_port)
    deadline = time.monotonic() + timeout
    log(f"joining machine rank 0 at {address[0]}:{address[1]} (up to {timeout:.0f} s)")
    last_error = "no answer"
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection(address, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
        except OSError as err:
            last_error = err.strerror or str(err)
            time.sleep(1.0)
            continue
        with conn:
            _send(conn, {"machine_rank": cluster.machine_rank, "plan": _identity(plan), "storage": _read_probe(plan)})
            reply = _read_line(conn, deadline)
            if reply is None:
                last_error = "machine 0 did not answer"
                continue
            if "error" in reply:
                raise UserError(f"machine rank 0 refused this machine: {reply['error']}", reply.get("hint", HINT_JOIN))
            return  # go; closing first keeps machine 0's port free of TIME_WAIT
    raise UserError(f"could not reach machine rank 0 at {address[0]}:{address[1]} within {timeout:.0f} s "
                    f"(rdzv_timeout): {last_error}",
                    "start machine rank 0 too, and check --main-process-ip/--main-process-port and the firewall")  # fmt: skip
