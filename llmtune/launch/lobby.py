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

Own disks: a run whose checkpoints each machine can keep a copy of (DDP, ZeRO) goes on. Machine 0 tells each such
machine so, and the launcher tells its ranks (train/checkpoint/manifest.py: that machine's first rank then writes what rank 0
alone writes on shared storage). Each machine also reports the checkpoint it would resume from and the files of its
copy; machine 0 compares them with the manifest in the checkpoint's marker (which machine held which file when it
was saved) and stops a run where some machine lacks its ranks' files, naming the files and who held them.
Machines that all share output_dir skip both.
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
from llmtune.train.checkpoint import manifest  # torch-free

HINT_JOIN = "start `llmtune train` with the same recipe and flags on every machine, each with its own --machine-rank"
HINT_SHARED = ("put output_dir on a filesystem every machine mounts (the same path on each), or set save_only_model: "
               "true (weight snapshots, no resume)")  # fmt: skip
STORAGE_PROBE = "machine-0-token"  # in plan.config_dir: machine 0's token, read by the others as they check in
# strategies whose resume reads files only rank 0 writes or other machines' shards: one shared output_dir or nothing
FSDP_FILES = "FSDP checkpoints (sharded: one .metadata and replicated state, written by rank 0; full: rank 0's alone)"
NEEDS_SHARED = {"fsdp1": FSDP_FILES, "fsdp2": FSDP_FILES,
                "pipeline": "pipeline checkpoints (rank 0 publishes every stage's files)"}  # fmt: skip


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


def _recipe(plan) -> dict:
    """The run's recipe as the plan files hold it (written before the check-in); {} when there are none."""
    try:
        return json.loads((Path(plan.config_dir) / "plan.json").read_text()).get("recipe") or {}
    except (OSError, ValueError):
        return {}


def _resume_report(plan) -> dict | None:
    """What this machine has of the checkpoint its ranks would resume from (train/checkpoint/manifest.py)."""
    recipe = _recipe(plan)
    output_dir = Path(recipe.get("output_dir") or Path(plan.config_dir).parent)
    try:
        return manifest.resume_report(output_dir, recipe.get("resume_from_checkpoint"),
                                      recipe.get("auto_resume_from_checkpoints", True))  # fmt: skip
    except OSError:
        return None


def _identity(plan) -> dict:
    return {"world_size": plan.world_size, "num_machines": plan.cluster.num_machines, "strategy": plan.strategy,
            "global_batch_size": plan.global_batch_size, "recipe": plan.recipe_digest}  # fmt: skip


def _differences(theirs: dict | None, mine: dict) -> str:
    """What a machine plans that machine 0 doesn't, said in words: the sizes, or that the recipe itself differs."""
    theirs = theirs if isinstance(theirs, dict) else {}
    sizes = [f"{key} {theirs.get(key)} (machine 0: {value})" for key, value in mine.items()
             if key != "recipe" and theirs.get(key) != value]  # fmt: skip
    if theirs.get("recipe") != mine.get("recipe"):
        sizes.append("another recipe than machine 0's (a different file, or the same file with other values: "
                     "learning rate, steps, data...)")  # fmt: skip
    return ", ".join(sizes)


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


def gather(plan, timeout: float, log=print) -> dict[str, str]:
    """Machine rank 0: wait until every other machine has checked in with a matching plan. Returns what the
    launcher adds to its ranks' environment."""
    cluster = plan.cluster
    expected = set(range(1, cluster.num_machines))
    me = _identity(plan)
    token = _write_probe(plan)
    own_disk: list[int] = []  # machine ranks that don't see machine 0's output_dir
    reports: dict[int, dict | None] = {}  # machine rank -> its resume report
    addresses = {0: cluster.main_process_ip}
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
                _refuse_joined(joined, UserError(
                    f"machine rank(s) {', '.join(map(str, missing))} of {cluster.num_machines} did not join within "
                    f"{timeout:.0f} s (rdzv_timeout) at port {cluster.main_process_port}",
                    f"{HINT_JOIN}; check they reach {cluster.main_process_ip}:{cluster.main_process_port} "
                    "(address, firewall)"))  # fmt: skip
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
                problem = (f"machine rank {hello['machine_rank']} ({address[0]}) plans "
                           f"{_differences(hello.get('plan'), me)}")  # fmt: skip
            if problem:
                try:
                    _send(conn, {"error": problem})
                finally:
                    conn.close()
                if hello and "machine_rank" in hello and "plan" in hello and hello.get("plan") != me:
                    _refuse_joined(joined, UserError(problem, "start every machine with the same recipe and cluster "
                                                              "flags"))  # fmt: skip
                log(f"ignored: {problem}")
                continue
            joined[hello["machine_rank"]] = conn
            reports[hello["machine_rank"]], addresses[hello["machine_rank"]] = hello.get("resume"), address[0]
            shared = hello.get("storage") == token
            if not shared:
                own_disk.append(hello["machine_rank"])
            log(f"machine rank {hello['machine_rank']} joined from {address[0]} "
                f"({'shares this output_dir' if shared else 'its own output_dir: not shared with machine 0'})")  # fmt: skip
        refusal = _storage_refusal(plan, sorted(own_disk))
        if not refusal and own_disk:
            reports[0] = _resume_report(plan)
            refusal = manifest.resume_refusal(reports, addresses)
        for rank, conn in joined.items():
            _send(conn, {"error": refusal[0], "hint": refusal[1]} if refusal else
                  {"go": True, "own_disk": rank in own_disk, "address": addresses[rank]})  # fmt: skip
        for conn in joined.values():  # let the other side close first, so this port is not left in TIME_WAIT
            _read_line(conn, time.monotonic() + 5)
    finally:
        for conn in joined.values():
            conn.close()
        server.close()
    if refusal:
        raise UserError(*refusal)
    return {manifest.MACHINE_RANK_ENV: "0", manifest.ADDRESS_ENV: str(cluster.main_process_ip)}


def _refuse_joined(joined: dict, error: UserError) -> None:
    """Machine 0 stops the launch: the machines that did join hear why (else each would wait out its own timeout and
    blame machine 0), then machine 0 raises it."""
    for conn in joined.values():
        try:
            _send(conn, {"error": error.message, "hint": error.hint})
        except OSError:
            pass
    raise error


def _storage_refusal(plan, own_disk: list[int]) -> tuple[str, str] | None:
    needs = getattr(plan, "shared_output_dir", None)
    if not needs and plan.strategy in NEEDS_SHARED:
        recipe = _recipe(plan)
        saves = recipe.get("save_strategy") != "no" and not recipe.get("save_only_model")
        needs = NEEDS_SHARED[plan.strategy] if saves else None
    if not needs or not own_disk:
        return None
    return (f"{needs} need output_dir on storage every machine shares, but machine rank(s) "
            f"{', '.join(map(str, own_disk))} can't see the file machine 0 just wrote in {plan.config_dir}",
            HINT_SHARED)  # fmt: skip


def join(plan, timeout: float, log=print) -> dict[str, str]:
    """Machine rank > 0: check in with machine 0 and wait for its go. Returns what the launcher adds to its ranks'
    environment."""
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
            _send(conn, {"machine_rank": cluster.machine_rank, "plan": _identity(plan), "storage": _read_probe(plan),
                         "resume": _resume_report(plan)})  # fmt: skip
            reply = _read_line(conn, deadline)
            if reply is None:
                last_error = "machine 0 did not answer"
                continue
            if "error" in reply:
                raise UserError(f"machine rank 0 stopped the launch: {reply['error']}", reply.get("hint", HINT_JOIN))
            env = {manifest.MACHINE_RANK_ENV: str(cluster.machine_rank)}
            if reply.get("address"):
                env[manifest.ADDRESS_ENV] = reply["address"]
            if reply.get("own_disk"):
                log("this machine has its own output_dir: its first rank writes a full copy of each checkpoint")
                env[manifest.OWN_DISK_ENV] = "1"
            return env  # go; closing first keeps machine 0's port free of TIME_WAIT
    raise UserError(f"could not reach machine rank 0 at {address[0]}:{address[1]} within {timeout:.0f} s "
                    f"(rdzv_timeout): {last_error}",
                    "start machine rank 0 too, and check --main-process-ip/--main-process-port and the firewall")  # fmt: skip
