"""The doctor's judgement of what the ranks reported (llmtune/doctor/checks.py): each problem names the machine or
rank and what to do; a healthy cluster has none."""

from __future__ import annotations

import copy

from llmtune.doctor import checks, report

GB = 2**30
PLAN_GPU = {"world_size": 4, "strategy": "ddp", "cluster": {"device": "cuda", "num_machines": 2, "backend": None}}


def rank(r: int, host: str, **changes) -> dict:
    base = {
        "rank": r, "host": host,
        "stack": {"python": "3.11.7", "torch": "2.11.0", "transformers": "5.24.0", "nccl": "2.27.3"},
        "devices": {"gpus": 2, "gpu_name": "NVIDIA H100 80GB HBM3", "free_bytes": 79 * GB, "total_bytes": 80 * GB},
        "storage": {"writable": True, "free_bytes": 500 * GB, "inputs": {"base_model": True}, "tokens_seen": [0, 1, 2, 3]},
        "network": {"backend": "nccl", "interface_variable": "NCCL_SOCKET_IFNAME", "interface": "eth0",
                    "address": f"10.0.0.{1 + r // 2}", "shm_bytes": 64 * GB, "open_files": 65536, "memlock": None,
                    "asks_infiniband": False, "asks_efa": False, "fabric_devices": []},
        "clock": 1000.0 + r * 0.01,
        "collectives": {"correct": {"all_reduce": True, "all_gather": True, "broadcast": True},
                        "bandwidth": {"world": [{"bytes": 1 << 20, "seconds": 0.001, "busbw": 1.5e9}]},
                        "ring": {"from_rank": (r - 1) % 4, "seconds": 0.01, "bytes": 128 << 20, "bandwidth": 1.3e10}},
    }  # fmt: skip
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            base[section] = {**base[section], field: value}
        else:
            base[section] = value
    return base


def cluster(**odd) -> list[dict]:
    """Four ranks on two machines; `odd` changes rank 3 (on node-b)."""
    return [rank(0, "node-a"), rank(1, "node-a"), rank(2, "node-b"), rank(3, "node-b", **odd)]


def lines(reports, plan=PLAN_GPU, **needs):
    problems, notes = checks.findings(reports, plan, **needs)
    return [p.line() for p in problems], notes


def test_a_healthy_cluster_has_no_problem_and_says_the_output_is_shared():
    problems, notes = lines(cluster(), gpu_bytes=60 * GB, checkpoint_bytes=20 * GB)
    assert problems == [] and "output_dir is shared by every machine" in notes
    text = "\n".join(report.machine_lines(cluster()) + report.verdict_lines([], notes, 12.0))
    assert "machine node-a: ranks 0, 1" in text and "doctor: healthy (12 s)" in text


def test_each_kind_of_problem_is_one_line_naming_where_and_what_to_do():
    reports = cluster()
    reports[2]["stack"] = {**reports[2]["stack"], "nccl": "2.21.5"}
    reports[3]["stack"] = {**reports[3]["stack"], "nccl": "2.21.5"}
    problems, _ = lines(reports)
    assert problems == ["machine node-b (ranks 2-3): has nccl 2.21.5, the other machines nccl 2.27.3 (fix: install "
                        "nccl 2.27.3 there: every machine must run the same stack)"]  # fmt: skip
    cases = [
        (cluster(devices__free_bytes=10 * GB), {"gpu_bytes": 60 * GB}, "rank 3 (node-b): its GPU has 10.0 GB free, the plan needs about 60.0 GB"),
        ([rank(0, "node-a"), rank(1, "node-a"), rank(2, "node-b", devices={**rank(2, "b")["devices"], "gpus": 1}),
          rank(3, "node-b", devices={**rank(3, "b")["devices"], "gpus": 1})], {}, "machine node-b (ranks 2-3): has 1 GPU(s) for 2 process(es)"),
        (cluster(storage__writable=False), {}, ""),  # only rank 3 of node-b: the machine's first rank speaks for it
        (cluster(network__shm_bytes=64 * 2**20), {}, ""),
        (cluster(clock=1010.0), {}, "rank 3 (node-b): its clock is 10.0 s off the others'"),
        (cluster(collectives={**rank(3, "b")["collectives"], "correct": {"all_reduce": False, "all_gather": True,
                                                                          "broadcast": True}}), {},
         "rank 3 (node-b): got wrong results from all_reduce"),
        (cluster(collectives={**rank(3, "b")["collectives"], "ring": {"from_rank": 2, "seconds": 0.2, "bytes": 128 << 20,
                                                                       "bandwidth": 6.7e8}}), {},
         "rank 3 (node-b): receives from rank 2 at 670 MB/s, 20.0x slower than the other links"),
        ([rank(0, "node-a"), rank(1, "node-a"), rank(2, "node-b")], {}, "rank(s) 3: did not report"),
    ]  # fmt: skip
    for reports, needs, expected in cases:
        problems, _ = lines(reports, **needs)
        if expected:
            assert any(p.startswith(expected) for p in problems), (expected, problems)
    # what a machine's first rank reports stands for the machine (rank 2 on node-b)
    first = cluster()
    first[2] = rank(2, "node-b", storage={**rank(2, "b")["storage"], "writable": False, "inputs": {"base_model": False}},
                    network={**rank(2, "b")["network"], "shm_bytes": 64 * 2**20, "asks_infiniband": True})  # fmt: skip
    problems, _ = lines(first, checkpoint_bytes=300 * GB)
    joined = "\n".join(problems)
    for words in ("machine node-b (ranks 2-3): can't write in output_dir", "can't read base_model",
                  "/dev/shm is 64 MB", "asks NCCL for InfiniBand but no device", "has 500.0 GB free where output_dir is"):
        assert words in joined, (words, joined)


def test_an_unshared_output_is_a_problem_for_sharded_checkpoints_and_a_note_otherwise():
    reports = cluster()
    for r in reports:
        r["storage"] = {**r["storage"], "tokens_seen": [0, 1] if r["host"] == "node-a" else [2, 3]}
    problems, notes = lines(reports)
    assert problems == [] and any(n.startswith("output_dir is not shared") for n in notes)
    fsdp = copy.deepcopy(PLAN_GPU) | {"strategy": "fsdp2"}
    problems, _ = lines(reports, plan=fsdp)
    assert problems == ["the machines: don't share output_dir, which fsdp2 checkpoints need (fix: put output_dir on "
                        "storage every machine mounts (NFS, Lustre, ...))"]  # fmt: skip
