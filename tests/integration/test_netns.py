"""Two hosts as network namespaces joined by a veth pair, each with its own address: one launcher in each.

This is what crosses a real network: the machine check-in, torchrun's rendezvous and gloo's connections all go
over 10.77.N.1 <-> 10.77.N.2, not over a shared loopback. The test makes and removes its namespaces itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import ROOT, losses, make_workspace, read_metrics, train_run, write_run_recipe

from llmtune.train.checkpoint.folders import MARKER

pytestmark = pytest.mark.integration


def _can_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"lt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"ip netns add failed: {made.stderr.strip()}"


WHY_NOT = _can_make_namespaces()


@pytest.fixture(scope="module")
def hosts():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    # distinct on the two xdist workers (their parity), whatever their process ids
    tag = os.getpid() % 100 * 2 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 2 + 20
    names = (f"lt-a-{tag}", f"lt-b-{tag}")
    addresses = (f"10.77.{tag}.1", f"10.77.{tag}.2")
    pair = (f"lta{tag}", f"ltb{tag}")
    links = ("ltnet", "ltnet")  # one interface name on every host, as on a cluster: one GLOO_SOCKET_IFNAME for all
    commands = [
        *[["ip", "netns", "add", n] for n in names],
        ["ip", "link", "add", pair[0], "type", "veth", "peer", "name", pair[1]],
        *[["ip", "link", "set", end, "netns", n] for end, n in zip(pair, names, strict=True)],
        *[["ip", "-n", n, "link", "set", end, "name", link] for end, n, link in zip(pair, names, links, strict=True)],
    ]
    for n, link, address in zip(names, links, addresses, strict=True):
        commands += [["ip", "-n", n, "addr", "add", f"{address}/24", "dev", link], ["ip", "-n", n, "link", "set", link, "up"],
                     ["ip", "-n", n, "link", "set", "lo", "up"]]  # fmt: skip
    for n in names:  # a namespace of this suite's name left by a run that was killed before its teardown
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        yield {"names": names, "addresses": addresses, "links": links}
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "netns", tiny_model)


def launcher(hosts, index: int, recipe: Path, port: int, env: dict | None = None, machine_rank: int | None = None,
             disk: tuple[Path, Path] | None = None) -> subprocess.Popen:  # fmt: skip
    """`llmtune train` as machine `index` of 2 (one process each; or as `machine_rank`), inside namespace `index`.
    `disk` (folder, output_dir): this host sees its own folder at output_dir."""
    rank = index if machine_rank is None else machine_rank
    main = hosts["addresses"][index if rank == 0 else 1 - index]
    flags = ["--device", "cpu", "--num-machines", "2", "--num-processes", "2", "--machine-rank", str(rank),
             "--main-process-ip", main, "--main-process-port", str(port)]  # fmt: skip
    return spawn_in(hosts, index, ["train", recipe, *flags], env, disk)


def finish(processes: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    results = []
    try:
        for process in processes:
            _, err = process.communicate(timeout=timeout)
            results.append((process.returncode, err))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
    return results


@pytest.fixture(scope="module")
def reference(workspace):
    """One process with the two-host jobs' global batch (2 x 4 = 4 x accumulation 2)."""
    return train_run(workspace, "reference", 1, gradient_accumulation_steps=2)[0]


def test_two_hosts_train_as_one_job(hosts, workspace, reference):
    recipe = write_run_recipe(workspace, "two-hosts")
    results = finish([launcher(hosts, 0, recipe, 29611), launcher(hosts, 1, recipe, 29611)])
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    metrics = read_metrics(recipe)
    assert metrics["world_size"] == 2 and len({r["first_batch"] for r in metrics["ranks"]}) == 2
    assert losses(metrics) == pytest.approx(losses(reference), abs=2e-5)


@pytest.mark.parametrize("present", [0, 1], ids=["only-machine-0", "only-machine-1"])
def test_a_host_that_never_joins_is_named_within_the_timeout(hosts, workspace, present):
    recipe = write_run_recipe(workspace, f"alone-{present}", rdzv_timeout=8)
    started = time.monotonic()
    [(code, err)] = finish([launcher(hosts, present, recipe, 29612)], timeout=120)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert time.monotonic() - started < 60
    if present == 0:
        assert "machine rank(s) 1 of 2 did not join within 8 s" in err
    else:
        assert f"could not reach machine rank 0 at {hosts['addresses'][0]}:29612" in err


@pytest.mark.parametrize("present", [0, 1], ids=["only-machine-0", "only-machine-1"])
def test_elastic_rendezvous_that_never_forms_is_one_line(hosts, workspace, present):
    recipe = write_run_recipe(workspace, f"c10d-alone-{present}", rdzv_backend="c10d", rdzv_timeout=8)
    started = time.monotonic()
    [(code, err)] = finish([launcher(hosts, present, recipe, 29617)], timeout=120)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert time.monotonic() - started < 60
    address = f"{hosts['addresses'][0]}:29617"
    if present == 0:
        assert f"error: the c10d rendezvous at {address} did not gather 2 machine(s) within 8 s (rdzv_timeout)" in err
    else:
        assert f"error: could not reach the c10d rendezvous store at {address} (machine rank 0 hosts it" in err


# A machine lost mid-run: 2 epochs of 4 steps, a checkpoint every 3 steps. Machine 1's ranks stop moving right
# after checkpoint 3 (while machine 0's go on into step 4 and wait for them), then every process in machine 1's
# namespace is killed: the machine is gone, as after a power cut.
LOST = {"num_epochs": 2, "save_strategy": "steps", "save_steps": 3, "logging_steps": 1}


def kill_machine(hosts, index: int, pause_file: Path, deadline: float = 300) -> None:
    """Wait until machine `index` paused after its checkpoint, then SIGKILL every process in its namespace."""
    started = time.monotonic()
    while not pause_file.exists():
        assert time.monotonic() - started < deadline, "machine 1 never reached the checkpoint"
        time.sleep(0.2)
    pids = subprocess.run(["ip", "netns", "pids", hosts["names"][index]], capture_output=True, text=True).stdout.split()
    assert pids, "no process in the namespace to kill"
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


def test_a_machine_lost_mid_run_stops_the_job_naming_it(hosts, workspace, tmp_path):
    recipe = write_run_recipe(workspace, "lost-static", **LOST)
    pause = tmp_path / "paused"
    survivor = launcher(hosts, 0, recipe, 29613)
    lost = launcher(hosts, 1, recipe, 29613, {"LLMTUNE_TEST_PAUSE_AFTER_STEP": 3, "LLMTUNE_TEST_PAUSE_FILE": pause})
    try:
        kill_machine(hosts, 1, pause)
        killed_at = time.monotonic()
        [(code, err)] = finish([survivor], timeout=300)
        stopped_after = time.monotonic() - killed_at
    finally:
        finish([lost], timeout=30)
    assert code == 1, err[-3000:]
    assert stopped_after < 60, f"machine 0 took {stopped_after:.0f} s to notice"
    # the survivor names the machine it lost, by address, and says how to go on
    assert f"lost contact with {hosts['addresses'][1]}" in err, err[-3000:]
    assert "to resume from the last complete checkpoint, run the same command again" in err
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    assert (out / "checkpoint-3" / "llmtune-complete.json").is_file() and not (out / "metrics.json").exists()


def test_elastic_job_survives_a_machine_restart(hosts, workspace, tmp_path):
    """c10d rendezvous + max_restarts: machine 0 waits for the lost machine to come back, and the job resumes from
    checkpoint 3 and finishes with the uninterrupted run's losses."""
    reference, _ = train_run(workspace, "lost-reference", 1, gradient_accumulation_steps=2, **LOST)
    recipe = write_run_recipe(workspace, "lost-elastic", rdzv_backend="c10d", max_restarts=1, rdzv_timeout=120, **LOST)
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    pause = tmp_path / "paused"
    survivor = launcher(hosts, 0, recipe, 29614)
    lost = launcher(hosts, 1, recipe, 29614, {"LLMTUNE_TEST_PAUSE_AFTER_STEP": 3, "LLMTUNE_TEST_PAUSE_FILE": pause})
    try:
        kill_machine(hosts, 1, pause)
        finish([lost], timeout=30)
        rebooted = launcher(hosts, 1, recipe, 29614)  # the machine is back: the same command as before
        results = finish([survivor, rebooted], timeout=600)
    finally:
        finish([survivor, lost], timeout=30)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert f"resuming from {out / 'checkpoint-3'}" in results[0][1] + results[1][1]
    metrics = read_metrics(recipe)
    assert metrics["steps"] == 8 and metrics["world_size"] == 2 and metrics["resumed_from"] == str(out / "checkpoint-3")
    resumed = [(e["step"], e["loss"]) for e in metrics["log_history"] if "loss" in e and e["step"] > 3]
    expected = [(e["step"], e["loss"]) for e in reference["log_history"] if "loss" in e and e["step"] > 3]
    assert [s for s, _ in resumed] == [4, 5, 6, 7, 8]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in expected], abs=2e-5)


# DeepSpeed's own launcher. Over ssh: machine 0 reads the hostfile and starts every machine with pdsh; each host
# runs an sshd in its namespace, reached with a key made for the test (pdsh's ssh gets it via PDSH_SSH_ARGS_APPEND).


def _missing_ssh_tools() -> str | None:
    missing = [tool for tool in ("pdsh", "ssh", "ssh-keygen") if shutil.which(tool) is None]
    missing += [] if Path("/usr/sbin/sshd").exists() else ["sshd"]
    return f"not installed: {', '.join(missing)} (.ci/run installs pdsh and openssh-server)" if missing else None


@pytest.fixture(scope="module")
def ssh_env(hosts, tmp_path_factory):
    why = _missing_ssh_tools()
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    daemons = []
    try:
        for index, (name, address) in enumerate(zip(hosts["names"], hosts["addresses"], strict=True)):
            config = folder / f"sshd-{index}.conf"
            config.write_text("\n".join([
                f"ListenAddress {address}", "Port 22", f"HostKey {folder / 'host_key'}",
                f"AuthorizedKeysFile {folder / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                f"PidFile {folder / f'sshd-{index}.pid'}", ""]))  # fmt: skip
            daemons.append(subprocess.Popen(["ip", "netns", "exec", name, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        options = (
            f"-i {folder / 'client_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        )
        env = {"PDSH_SSH_ARGS_APPEND": options}
        for address in hosts["addresses"]:  # wait until both answer
            for _ in range(50):
                probe = subprocess.run(["ip", "netns", "exec", hosts["names"][0], "ssh", "-o", "BatchMode=yes",
                                        *options.split(), address, "true"], capture_output=True)  # fmt: skip
                if probe.returncode == 0:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"sshd on {address} never answered: {probe.stderr.decode()[-500:]}")
        yield env
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def write_hostfile(workspace, name: str, addresses) -> Path:
    path = workspace[0] / name
    path.write_text("# machines of the test job\n" + "".join(f"{a} slots=1\n" for a in addresses))
    return path


def test_deepspeed_hostfile_launcher_over_ssh(hosts, ssh_env, workspace, reference):
    recipe = write_run_recipe(workspace, "ds-ssh", deepspeed="zero2")
    hostfile = write_hostfile(workspace, "hosts-ssh", hosts["addresses"])
    plan = llmtune_in(hosts, 0, ["plan", recipe, "--device", "cpu", "--launcher", "deepspeed", "--hostfile", hostfile])
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "deepspeed --hostfile" in plan.stdout and "over ssh" in plan.stdout
    # only machine 0 runs a command: DeepSpeed starts machine 1 itself
    done = llmtune_in(hosts, 0, ["train", recipe, "--device", "cpu", "--launcher", "deepspeed", "--hostfile", hostfile],
                      ssh_env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"ssh reaches all 2 machines: {', '.join(hosts['addresses'])}" in done.stderr
    # pdsh prefixes what each machine printed with its address: DeepSpeed's per-node launcher ran on both
    output = done.stdout + done.stderr
    for address in hosts["addresses"]:
        assert f"{address}: " in output and "deepspeed.launcher.launch" in output
    metrics = read_metrics(recipe)
    assert metrics["world_size"] == 2 and metrics["strategy"] == "zero2"
    assert len({r["first_batch"] for r in metrics["ranks"]}) == 2
    assert losses(metrics) == pytest.approx(losses(reference), abs=2e-5)


def test_deepspeed_hostfile_launcher_without_ssh(hosts, workspace, reference):
    recipe = write_run_recipe(workspace, "ds-no-ssh")
    hostfile = write_hostfile(workspace, "hosts-no-ssh", hosts["addresses"])
    flags = ["--launcher", "deepspeed", "--hostfile", hostfile, "--no-ssh"]  # the same (default) port on both
    processes = [
        spawn_in(hosts, i, ["train", recipe, "--device", "cpu", *flags, "--machine-rank", str(i)]) for i in (0, 1)
    ]
    results = finish(processes)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    metrics = read_metrics(recipe)
    assert metrics["world_size"] == 2 and len({r["first_batch"] for r in metrics["ranks"]}) == 2
    assert losses(metrics) == pytest.approx(losses(reference), abs=2e-5)


def test_a_host_ssh_cannot_reach_is_named_before_anything_starts(hosts, ssh_env, workspace):
    recipe = write_run_recipe(workspace, "ds-unreachable")
    ghost = hosts["addresses"][1].rsplit(".", 1)[0] + ".9"  # on the hosts' network, but no machine has it
    hostfile = write_hostfile(workspace, "hosts-ghost", [*hosts["addresses"], ghost])
    started = time.monotonic()
    done = llmtune_in(hosts, 0, ["train", recipe, "--device", "cpu", "--launcher", "deepspeed", "--hostfile", hostfile,
                                 "--num-processes", "3"], ssh_env, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"machine rank 2 ({ghost}) is not reachable over ssh" in done.stderr
    assert time.monotonic() - started < 60
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    assert not (out / "metrics.json").exists() and not list(out.glob("checkpoint-*"))


def spawn_in(hosts, index: int, args: list, env: dict | None = None, disk: tuple[Path, Path] | None = None):
    """`llmtune ARGS` inside namespace `index`; gloo told which interface to use. `disk` (folder, mount point): the
    folder is bind-mounted there in this process's own mount namespace (`ip netns exec` makes one per command), so
    each host has its own disk at the same path."""
    extra = [f"{k}={v}" for k, v in (env or {}).items()]
    mount = ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", *map(str, disk)] if disk else []
    argv = ["ip", "netns", "exec", hosts["names"][index], *mount, "env", f"GLOO_SOCKET_IFNAME={hosts['links'][index]}",
            "PYTHONUNBUFFERED=1", *extra, sys.executable, "-m", "llmtune", *map(str, args)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)  # fmt: skip


def llmtune_in(hosts, index: int, args: list, env: dict | None = None, timeout: float = 600):
    process = spawn_in(hosts, index, args, env)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_elastic_job_starts_with_the_machines_it_has_and_grows(hosts, workspace):
    """min_machines 1 of 2: machine 0 starts alone (world 1, accumulation 2: the same global batch). When machine 1
    comes, torchrun restarts the ranks into a world of 2, which resume from the last checkpoint. Every step's loss
    equals the single-process reference, whichever world computed it."""
    recipe = write_run_recipe(workspace, "grows", rdzv_backend="c10d", min_machines=1, rdzv_timeout=60,
                              save_strategy="steps", save_steps=2, logging_steps=1, num_epochs=2)  # fmt: skip
    grown_reference = train_run(workspace, "grows-reference", 1, gradient_accumulation_steps=2, logging_steps=1,
                                num_epochs=2)[0]  # fmt: skip
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    alone = launcher(hosts, 0, recipe, 29616, {"LLMTUNE_TEST_STEP_SLEEP": 1})
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2" / "llmtune-complete.json").is_file():
            assert time.monotonic() < deadline and alone.poll() is None, "machine 0 never trained alone"
            time.sleep(0.2)
        joined = launcher(hosts, 1, recipe, 29616)
        results = finish([alone, joined], timeout=600)
    finally:
        finish([alone], timeout=30)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    err = results[0][1]
    assert "elastic: 1 process(es) joined, so gradient accumulation is 2 (global batch 8 kept)" in err
    metrics = read_metrics(recipe)
    assert metrics["world_size"] == 2 and metrics["steps"] == 8  # finished as a world of 2 ...
    assert metrics["resumed_from"] and metrics["resumed_from"].startswith(
        str(out / "checkpoint-")
    )  # ... after resuming
    assert losses(metrics) == pytest.approx(losses(grown_reference), abs=2e-5)


def test_machines_with_their_own_disks_resume_only_on_the_machines_that_saved(hosts, workspace):
    """Each host sees its own folder at output_dir. A 2-machine DDP run saves checkpoint-2 (machine 1 then killed):
    each host holds a copy its ranks resume from, and the marker says who holds what. Started with the machine ranks
    swapped it is refused at check-in, in one line; on the same machines it resumes and finishes."""
    recipe = write_run_recipe(workspace, "own-disks", save_strategy="steps", save_steps=2, logging_steps=1)
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    disks = [workspace[0] / f"own-disk-{i}" for i in (0, 1)]
    for folder in (out, *disks):
        folder.mkdir()
    started = time.monotonic()
    saved = finish([launcher(hosts, i, recipe, 29618, {"LLMTUNE_TEST_EXIT_AFTER_STEP": 2}, disk=(disks[i], out))
                    for i in (0, 1)])  # fmt: skip
    timings = {"save": time.monotonic() - started}
    assert [code for code, _ in saved] == [1, 1], saved[0][1][-3000:] + saved[1][1][-3000:]
    assert not list(out.iterdir())  # nothing went through to the shared folder under the mounts
    copies = [disk / "checkpoint-2" for disk in disks]
    markers = [json.loads((copy / MARKER).read_text()) for copy in copies]
    assert markers[0]["machines"] == markers[1]["machines"]
    machines = markers[0]["machines"]
    assert [(m["machine_rank"], m["address"]) for m in machines] == list(enumerate(hosts["addresses"]))
    for copy, entry in zip(copies, machines, strict=True):  # the manifest lists what each host's copy holds
        held = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file() and p.name != MARKER)
        assert held == entry["files"]
    common = {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"}  # machine 1 wrote them too
    assert common <= set(machines[1]["files"]) and common <= set(machines[0]["files"])
    assert "rng_state_0.pth" in machines[0]["files"] and "rng_state_0.pth" not in machines[1]["files"]
    assert "rng_state_1.pth" in machines[1]["files"] and "rng_state_1.pth" not in machines[0]["files"]

    started = time.monotonic()
    swapped = finish([launcher(hosts, i, recipe, 29618, machine_rank=1 - i, disk=(disks[i], out)) for i in (0, 1)])
    timings["refused"] = time.monotonic() - started
    assert [code for code, _ in swapped] == [2, 2], swapped[0][1][-3000:] + swapped[1][1][-3000:]
    a, b = hosts["addresses"]
    for _, err in swapped:
        [line] = [line for line in err.splitlines() if "can't resume from" in line]
        assert "machine rank 0 lacks 1 file(s) of checkpoint-2 (rng_state_0.pth), held by machine rank 0" in line
        assert f"{a}) when it was saved (now machine rank 1); machine rank 1 lacks 1 file(s) of checkpoint-2 " in line
        assert "(rng_state_1.pth), held by machine rank 1" in line
        assert f"{b}) when it was saved (now machine rank 0)" in line
        assert "Traceback" not in err and "resuming from" not in err
    assert [json.loads((copy / MARKER).read_text()) for copy in copies] == markers  # nothing touched
    assert not [p for disk in disks for p in disk.glob("checkpoint-*") if p.name != "checkpoint-2"]

    started = time.monotonic()
    resumed = finish([launcher(hosts, i, recipe, 29618, disk=(disks[i], out)) for i in (0, 1)])
    timings["resumed"] = time.monotonic() - started
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    assert "this machine has its own output_dir" in resumed[1][1]
    metrics = json.loads((disks[0] / "metrics.json").read_text())  # rank 0 writes it, on machine 0's disk
    assert metrics["steps"] == 4 and metrics["world_size"] == 2 and metrics["resumed_from"] == str(out / "checkpoint-2")
    assert len(metrics["step_seconds"]) == 2  # this run trained steps 3 and 4 only
    assert f"resuming from {out / 'checkpoint-2'}" in resumed[0][1]
    for disk in disks:  # each machine published its own copy of the new checkpoint
        assert json.loads((disk / "checkpoint-4" / MARKER).read_text())["step"] == 4
    print(f"own disks: {', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}")
