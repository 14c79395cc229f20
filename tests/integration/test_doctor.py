"""`llmtune doctor` (issue 38), launched as `llmtune train` would be, on CPU processes over gloo:

- one machine, 2 ranks: healthy, exit 0, collectives correct, all_reduce bus bandwidth at three sizes, the ring's
  links; --json carries the same;
- a rendezvous port already taken: one line naming the port, exit 2, nothing launched;
- two network-namespace machines, machine 1 with its own disk and another transformers (a test hook): exit 2, the
  version named on machine 1 with both versions, and output_dir found not shared.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml
from harness import llmtune, make_workspace, write_run_recipe
from test_netns import finish, hosts, spawn_in  # noqa: F401 (hosts: the namespace fixture)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "doctor", tiny_model)


def test_a_healthy_machine_passes_and_reports_its_bandwidth(workspace):
    recipe = write_run_recipe(workspace, "doctor-one")
    result = llmtune("doctor", recipe, "--num-processes", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    out = result.stdout
    assert "collectives: all_reduce, all_gather, broadcast correct on every rank" in out
    assert "all_reduce bus bandwidth (world): 64 KiB" in out and "8 MiB" in out
    assert "ring links (8 MiB each): 1->0" in out and "0->1" in out
    assert "doctor: healthy" in out and "Traceback" not in result.stderr
    as_json = llmtune("doctor", recipe, "--num-processes", "2", "--json", timeout=300)
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    verdict = json.loads(as_json.stdout)
    assert verdict["healthy"] and verdict["problems"] == [] and len(verdict["reports"]) == 2
    rows = verdict["reports"][0]["collectives"]["bandwidth"]["world"]
    assert [r["bytes"] for r in rows] == [64 << 10, 1 << 20, 8 << 20] and all(r["busbw"] > 0 for r in rows)
    assert {r["rank"] for r in verdict["reports"]} == {0, 1}


def test_a_taken_rendezvous_port_is_one_line(workspace):
    recipe = write_run_recipe(workspace, "doctor-port")
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        result = llmtune("doctor", recipe, "--num-processes", "2", "--main-process-port", str(port), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--main-process-port {port} is already in use on this machine" in result.stderr.strip().splitlines()[-1]


def test_two_machines_name_the_odd_stack_and_the_unshared_output(hosts, workspace, tmp_path):  # noqa: F811
    recipe = write_run_recipe(workspace, "doctor-two")
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    own = tmp_path / "machine-1-disk"
    own.mkdir()
    out.mkdir(parents=True, exist_ok=True)  # where machine 1's own disk is mounted
    flags = ["--device", "cpu", "--num-machines", "2", "--num-processes", "2", "--main-process-ip",
             hosts["addresses"][0], "--main-process-port", "29631"]  # fmt: skip
    recipe.write_text(recipe.read_text() + "rdzv_timeout: 60\n")  # a machine that never comes fails in a minute
    machines = [spawn_in(hosts, 0, ["doctor", recipe, *flags, "--machine-rank", "0", "--json"]),
                spawn_in(hosts, 1, ["doctor", recipe, *flags, "--machine-rank", "1"],
                         {"LLMTUNE_TEST_STACK_OVERRIDE": "transformers=0.0.1"}, disk=(own, out))]  # fmt: skip
    outputs = []
    try:
        for process in machines:
            outputs.append((process.returncode, *process.communicate(timeout=300)))
    finally:
        finish(machines, timeout=10)
    (_, stdout_0, err_0), (_, _, err_1) = outputs
    assert machines[1].returncode == 0, err_1[-3000:]
    assert machines[0].returncode == 2, err_0[-3000:]
    verdict = json.loads(stdout_0)
    where = f"machine {hosts['addresses'][1]} (rank 1)"
    problems = {(p["where"], p["what"]) for p in verdict["problems"]}
    version = next(r["stack"]["transformers"] for r in verdict["reports"] if r["rank"] == 0)
    assert (where, f"has transformers 0.0.1, the other machines transformers {version}") in problems, problems
    assert any(note.startswith("output_dir is not shared") for note in verdict["notes"]), verdict["notes"]
    assert "inter-node" in verdict["reports"][0]["collectives"]["bandwidth"]  # measured across the two hosts
