"""rdzv_backend: etcd on two network-namespace hosts, with Debian's etcd-server in a third namespace on the same
bridge (issue 37): the rendezvous lives off the training machines, so the job survives losing machine 0.

- machine 0 is lost after checkpoint 3 (every process in its namespace killed); machine 1's torchrun agent restarts
  its rank into a new round of the etcd rendezvous with the one machine left (min_machines 1, max_restarts 1); the
  rank resumes from checkpoint 3 at world size 1 with the same global batch (gradient accumulation 2) and finishes
  with exit 0, every step's loss equal to one process's;
- an etcd endpoint that doesn't answer is one line naming it, exit 2, before any process starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from harness import make_workspace, read_metrics, train_run, write_run_recipe
from test_netns import WHY_NOT, finish, kill_machine, spawn_in

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def etcd_hosts(tmp_path_factory):
    """Namespaces: etcd's (with a bridge) and two hosts attached to the bridge; etcd serving its v2 API."""
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (.ci/run installs Debian's etcd-server)")
    # distinct on the two xdist workers (their parity), whatever their process ids
    tag = os.getpid() % 100 * 2 + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 2 + 20
    server, names = f"lt-e-{tag}", (f"lt-x-{tag}", f"lt-y-{tag}")
    subnet = f"10.78.{tag}"
    for n in (server, *names):  # a namespace of this suite's name left by a run killed before its teardown
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    commands = [["ip", "netns", "add", n] for n in (server, *names)]
    commands += [["ip", "-n", server, "link", "add", "br0", "type", "bridge"],
                 ["ip", "-n", server, "addr", "add", f"{subnet}.10/24", "dev", "br0"],
                 ["ip", "-n", server, "link", "set", "br0", "up"], ["ip", "-n", server, "link", "set", "lo", "up"]]  # fmt: skip
    addresses = []
    for index, name in enumerate(names):
        inside, outside, address = f"lth{tag}{index}", f"lts{tag}{index}", f"{subnet}.{index + 1}"
        addresses.append(address)
        commands += [["ip", "link", "add", inside, "type", "veth", "peer", "name", outside],
                     ["ip", "link", "set", inside, "netns", name], ["ip", "link", "set", outside, "netns", server],
                     ["ip", "-n", name, "link", "set", inside, "name", "ltnet"],
                     ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "ltnet"],
                     ["ip", "-n", name, "link", "set", "ltnet", "up"], ["ip", "-n", name, "link", "set", "lo", "up"],
                     ["ip", "-n", server, "link", "set", outside, "master", "br0"],
                     ["ip", "-n", server, "link", "set", outside, "up"]]  # fmt: skip
    data = tmp_path_factory.mktemp("etcd")
    daemon = None
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        client = f"http://{subnet}.10:2379"
        daemon = subprocess.Popen(
            ["ip", "netns", "exec", server, "etcd", "--data-dir", str(data), "--enable-v2=true",
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "default=http://127.0.0.1:2380"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        probe = f"import urllib.request as u; u.urlopen('{client}/version', timeout=1)"
        deadline = time.monotonic() + 30
        while subprocess.run(["ip", "netns", "exec", names[0], "python3", "-c", probe], capture_output=True).returncode:
            assert time.monotonic() < deadline and daemon.poll() is None, "etcd did not start"
            time.sleep(0.3)
        yield {"names": names, "addresses": tuple(addresses), "links": ("ltnet", "ltnet"), "endpoint": f"{subnet}.10:2379"}
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        for n in (*names, server):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "etcd", tiny_model)


def launcher(hosts, index: int, recipe: Path, env: dict | None = None):
    flags = ["--device", "cpu", "--num-machines", "2", "--num-processes", "2", "--machine-rank", str(index),
             "--main-process-ip", hosts["addresses"][0], "--main-process-port", "29620"]  # fmt: skip
    return spawn_in(hosts, index, ["train", recipe, *flags], env)


LOST = {"num_epochs": 2, "save_strategy": "steps", "save_steps": 3, "logging_steps": 1}


def test_the_job_survives_losing_machine_0(etcd_hosts, workspace, tmp_path):
    reference, _ = train_run(workspace, "etcd-reference", 1, gradient_accumulation_steps=2, **LOST)
    recipe = write_run_recipe(workspace, "etcd-lost-0", rdzv_backend="etcd", rdzv_endpoint=etcd_hosts["endpoint"],
                              min_machines=1, max_restarts=1, rdzv_timeout=60, **LOST)  # fmt: skip
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    pause = tmp_path / "paused"
    machine_0 = launcher(etcd_hosts, 0, recipe, {"LLMTUNE_TEST_PAUSE_AFTER_STEP": 3, "LLMTUNE_TEST_PAUSE_FILE": pause})
    machine_1 = launcher(etcd_hosts, 1, recipe)
    try:
        kill_machine(etcd_hosts, 0, pause)  # machine 0 is gone after checkpoint 3, its launcher and agent with it
        [(code, err)] = finish([machine_1], timeout=600)
    finally:
        finish([machine_0, machine_1], timeout=30)
    assert code == 0, err[-4000:]
    assert f"etcd rendezvous at {etcd_hosts['endpoint']}" in err and f"resuming from {out / 'checkpoint-3'}" in err
    assert "gradient accumulation is 2 (global batch 8 kept)" in err
    metrics = read_metrics(recipe)
    assert metrics["steps"] == 8 and metrics["world_size"] == 1 and metrics["resumed_from"] == str(out / "checkpoint-3")
    resumed = [(e["step"], e["loss"]) for e in metrics["log_history"] if "loss" in e and e["step"] > 3]
    expected = [(e["step"], e["loss"]) for e in reference["log_history"] if "loss" in e and e["step"] > 3]
    assert [s for s, _ in resumed] == [4, 5, 6, 7, 8]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in expected], abs=2e-5)


def test_an_etcd_that_does_not_answer_is_one_line(etcd_hosts, workspace):
    nowhere = etcd_hosts["endpoint"].replace(".10:", ".99:")
    recipe = write_run_recipe(workspace, "etcd-nowhere", rdzv_backend="etcd", rdzv_endpoint=nowhere)
    started = time.monotonic()
    [(code, err)] = finish([launcher(etcd_hosts, 1, recipe)], timeout=120)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"error: the etcd server at {nowhere} (rdzv_endpoint) does not answer" in err
    assert time.monotonic() - started < 60
    assert not (Path(yaml.safe_load(recipe.read_text())["output_dir"]) / "llmtune" / "logs").exists()
