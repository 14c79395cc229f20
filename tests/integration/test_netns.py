"""Two hosts as network namespaces joined by a veth pair, each with its own address: one launcher in each.

This is what crosses a real network: the machine check-in, torchrun's rendezvous and gloo's connections all go
over 10.77.N.1 <-> 10.77.N.2, not over a shared loopback. The test makes and removes its namespaces itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import ROOT, losses, make_workspace, read_metrics, train_run, write_run_recipe

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
    tag = os.getpid() % 200 + 20
    names = (f"lt-a-{tag}", f"lt-b-{tag}")
    addresses = (f"10.77.{tag}.1", f"10.77.{tag}.2")
    links = (f"lta{tag}", f"ltb{tag}")
    commands = [
        *[["ip", "netns", "add", n] for n in names],
        ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]],
        *[["ip", "link", "set", link, "netns", n] for link, n in zip(links, names, strict=True)],
    ]
    for n, link, address in zip(names, links, addresses, strict=True):
        commands += [["ip", "-n", n, "addr", "add", f"{address}/24", "dev", link], ["ip", "-n", n, "link", "set", link, "up"],
                     ["ip", "-n", n, "link", "set", "lo", "up"]]  # fmt: skip
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


def launcher(hosts, index: int, recipe: Path, port: int, machines: tuple[int, ...] = (0, 1)) -> subprocess.Popen:
    """`llmtune train` as machine `index`, inside namespace `index`; gloo told which interface to use."""
    argv = ["ip", "netns", "exec", hosts["names"][index], "env", f"GLOO_SOCKET_IFNAME={hosts['links'][index]}",
            "PYTHONUNBUFFERED=1", sys.executable, "-m", "llmtune", "train", str(recipe), "--device", "cpu",
            "--num-machines", "2", "--num-processes", "2", "--machine-rank", str(index),
            "--main-process-ip", hosts["addresses"][0], "--main-process-port", str(port)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)  # fmt: skip


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


def test_two_hosts_train_as_one_job(hosts, workspace):
    reference, _ = train_run(workspace, "reference", 1, gradient_accumulation_steps=2)
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
