"""Multi-machine launchers: DeepSpeed hostfiles, the DeepSpeed and c10d commands, what runs where, lost peers."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.launch.failures import StderrWatcher, report
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.files import deepspeed_env_text, plan_files
from llmtune.plan.hostfile import read_hostfile
from llmtune.plan.render import command_lines, where_lines
from llmtune.recipe.loader import recipe_from_mapping


def recipe(**changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def hostfile(tmp_path, text: str) -> Path:
    path = tmp_path / "hosts"
    path.write_text(text)
    return path


def test_hostfile_lines_comments_and_default_slots(tmp_path):
    path = hostfile(tmp_path, "# cluster\nnode-a slots=4  # head\n\n  node-b\tslots=4\n")
    assert read_hostfile(path) == [("node-a", 4), ("node-b", 4)]
    # OpenMPI's form: DeepSpeed reads the slots and ignores what follows, and so does llmtune
    assert read_hostfile(hostfile(tmp_path, "node1 slots=8 max_slots=8\n")) == [("node1", 8)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node-a slots=4\nnode-b gpus=4\n", "line 2: can't read 'node-b gpus=4'"),
        ("node-a\n", "line 1: can't read 'node-a'"),  # DeepSpeed needs the slots, so llmtune does too
        ("node-a slots = 4\n", "line 1: can't read 'node-a slots = 4'"),
        ("node-a slots=4\nnode-a slots=4\n", "line 2: node-a is listed twice"),
        ("node-a slots=0\n", "line 1: node-a has slots=0"),
        ("node-a slots=4\nnode-b slots=2\n", "machines have different slots (node-a slots=4, node-b slots=2)"),
        ("# nothing\n", "lists no machine"),
    ],
)
def test_hostfile_mistakes_name_the_line(tmp_path, text, message):
    with pytest.raises(UserError, match="hostfile") as err:
        read_hostfile(hostfile(tmp_path, text))
    assert message in str(err.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_hostfile(tmp_path / "nope")


def test_the_hostfile_is_the_cluster(tmp_path):
    path = hostfile(tmp_path, "node-a slots=2\nnode-b slots=2\nnode-c slots=2\n")
    cluster = make_cluster(device="cpu", launcher="deepspeed", hostfile=str(path))
    assert (cluster.num_machines, cluster.num_processes, cluster.main_process_ip) == (3, 6, "node-a")
    assert cluster.hosts == ("node-a", "node-b", "node-c") and cluster.ssh
    with pytest.raises(UserError, match="--num-processes 4 but .* slots add up to 6"):
        make_cluster(num_processes=4, device="cpu", launcher="deepspeed", hostfile=str(path))
    with pytest.raises(UserError, match="--num-machines 2 but .* lists 3"):
        make_cluster(num_machines=2, device="cpu", launcher="deepspeed", hostfile=str(path))
    with pytest.raises(UserError, match="--machine-rank is only for --no-ssh"):
        make_cluster(machine_rank=1, device="cpu", launcher="deepspeed", hostfile=str(path))
    with pytest.raises(UserError, match="--hostfile is DeepSpeed's"):
        make_cluster(device="cpu", hostfile=str(path))
    with pytest.raises(UserError, match="needs --hostfile"):
        make_cluster(4, 2, 0, "10.0.0.1", None, "cpu", launcher="deepspeed")
    # rank 0 runs on the first line: another machine's address for the store would leave every rank waiting
    with pytest.raises(UserError, match="--main-process-ip node-b is line 2 of .*first line \\(node-a\\)"):
        make_cluster(device="cpu", launcher="deepspeed", hostfile=str(path), main_process_ip="node-b")


@pytest.mark.parametrize(("address", "message"), [
    ("10.0.0.1:29500", "carries a port (hint: pass --main-process-ip 10.0.0.1 --main-process-port 29500)"),
    ("[fe80::1]:29500", "carries a port (hint: pass --main-process-ip [fe80::1] --main-process-port 29500)"),
    ("node 1", "'node 1' is not a host name or address"),
    ("", "'' is not a host name or address"),
])  # fmt: skip
def test_a_main_process_ip_that_can_t_be_one_is_refused_before_any_wait(address, message):
    """With a port in it, every machine waited out rdzv_timeout (600 s) and then blamed name resolution."""
    with pytest.raises(UserError) as err:
        make_cluster(4, 2, 1, address, 29500, "cpu")
    assert message in err.value.one_line()
    assert make_cluster(4, 2, 1, "fe80::1", 29500, "cpu").main_process_ip == "fe80::1"  # IPv6 stays an address


def test_a_main_process_ip_on_one_machine_is_said_unused_and_not_written():
    """accelerate and torchrun ignore it on one machine: a user who forgot --num-machines must hear it."""
    plan = make_plan(recipe(), make_cluster(2, 1, 0, "10.0.0.5", None, "cpu"))
    assert any(note.startswith("--main-process-ip 10.0.0.5 is not used on one machine") and "--num-machines N" in note
               for note in plan.notes)  # fmt: skip
    assert plan.cluster.main_process_ip == "127.0.0.1"
    for address in ("127.0.0.1", "localhost", None):  # this machine: nothing to say
        assert make_cluster(2, 1, 0, address, None, "cpu").notes() == []
    assert make_cluster(4, 2, 0, "10.0.0.5", None, "cpu").notes() == []


def test_deepspeed_over_ssh_runs_on_machine_0_only(tmp_path):
    path = hostfile(tmp_path, "node-a slots=2\nnode-b slots=2\n")
    plan = make_plan(recipe(deepspeed="zero2"), make_cluster(device="cpu", launcher="deepspeed", hostfile=str(path)))
    head, other = plan.commands
    assert head[:3] == ["deepspeed", "--hostfile", str(path.resolve())]
    assert head[head.index("--master_addr") + 1] == "node-a" and "--no_ssh_check" in head
    assert head[-4:] == ["--no_local_rank", "--module", "llmtune.train", "/runs/x/llmtune/plan.json"]
    assert other == []
    assert command_lines(plan)[1] == "machine 1 (node-b): started by machine 0's DeepSpeed launcher over ssh (pdsh)"
    assert plan.env["DS_ENV_FILE"] == "/runs/x/llmtune/deepspeed_env"
    assert "hostfile" not in plan_files(plan, {}, "r.yaml", [])  # the user's hostfile is used as it is


def test_deepspeed_without_ssh_runs_on_every_machine(tmp_path):
    path = hostfile(tmp_path, "node-a slots=1\nnode-b slots=1\n")
    cluster = make_cluster(machine_rank=1, device="cpu", launcher="deepspeed", hostfile=str(path), no_ssh=True)
    plan = make_plan(recipe(), cluster)
    for rank, command in enumerate(plan.commands):
        at = command.index("--node_rank")
        assert command[at - 1 : at + 2] == ["--no_ssh", "--node_rank", str(rank)]


def test_deepspeed_on_one_machine_gets_a_hostfile_written():
    plan = make_plan(recipe(), make_cluster(num_processes=2, device="cpu", launcher="deepspeed"))
    assert plan.commands[0][2] == "/runs/x/llmtune/hostfile"
    assert plan_files(plan, {}, "r.yaml", [])["hostfile"] == "localhost slots=2\n"


def test_deepspeed_env_file_carries_settings_never_secrets():
    environ = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_IB_DISABLE": "1", "HF_TOKEN": "hf_secret", "HF_HOME": "/cache",
               "WANDB_API_KEY": "k", "NCCL_API_KEY": "x", "HOME": "/root", "PATH": "/bin"}  # fmt: skip
    environ["NCCL_DEBUG_FILE"] = "/logs/nccl.$HOSTNAME"  # a remote shell would expand it: left out
    text = deepspeed_env_text(
        {"OMP_NUM_THREADS": "1", "DS_ENV_FILE": "/x", "TORCHELASTIC_X": "[rank${rank}]:"}, environ
    )
    assert text.splitlines() == ["GLOO_SOCKET_IFNAME=eth1", "HF_HOME=/cache", "NCCL_IB_DISABLE=1", "OMP_NUM_THREADS=1"]


def test_deepspeed_launcher_refuses_torchrun_only_keys():
    with pytest.raises(UserError, match="max_restarts are torchrun's"):
        make_plan(recipe(max_restarts=2), make_cluster(num_processes=2, device="cpu", launcher="deepspeed"))


def test_c10d_commands(tmp_path):
    r = recipe(rdzv_backend="c10d", max_restarts=3, rdzv_timeout=90)
    for rank in (0, 1):
        plan = make_plan(r, make_cluster(4, 2, rank, "10.0.0.1", 29500, "cpu"))
        command = plan.commands[rank]
        conf = command[command.index("--rdzv_conf") + 1]
        assert command[command.index("--rdzv_backend") + 1] == "c10d"
        assert "join_timeout=90" in conf and f"is_host={int(rank == 0)}" in conf
        assert command[command.index("--max_restarts") + 1] == "3"
        assert plan.accelerate_config["rdzv_backend"] == "c10d" and plan.accelerate_config["same_network"] is False
        assert plan.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    static = make_plan(recipe(), make_cluster(4, 2, 0, "10.0.0.1", 29500, "cpu"))
    assert static.accelerate_config["same_network"] is True and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in static.env
    with pytest.raises(UserError, match="c10d is for jobs on several machines"):
        make_plan(r, make_cluster(2, device="cpu"))


def test_what_runs_where_under_each_launcher():
    plan = make_plan(recipe(), make_cluster(4, 2, 0, "10.0.0.1", 29500, "cpu"))
    text = "\n".join(where_lines(plan, "r.yaml"))
    assert (
        "--machine-rank 1 --main-process-ip 10.0.0.1 --main-process-port 29500  -> accelerate launch -> ranks 2..3"
        in text
    )
    assert "on 10.0.0.1 only: llmtune train r.yaml --device cpu --launcher deepspeed --hostfile HOSTFILE" in text
    assert "pdsh -> machine-1: python -m deepspeed.launcher.launch --node_rank=1 -> ranks 2..3" in text
    assert "--no-ssh --machine-rank 1 -> ranks 2..3" in text
    assert "llmtune slurm r.yaml --device cpu --nodes 2 --gpus-per-node 2 --submit" in text
    assert where_lines(make_plan(recipe(), make_cluster(2, device="cpu")), "r.yaml") == []
    elastic = make_plan(recipe(rdzv_backend="c10d"), make_cluster(4, 2, 0, "10.0.0.1", 29500, "cpu"))
    assert "2 rank(s), numbered at the rendezvous" in "\n".join(where_lines(elastic, "r.yaml"))


def test_a_lost_machine_is_named_by_its_address(tmp_path):
    stderr = io.StringIO(
        "[rank0]:RuntimeError: [pair.cc:553] Connection closed by peer [10.1.2.3]:4567. This is typically caused\n"
        "Traceback (most recent call last):\n"
        "Root Cause (first observed failure):\n[0]:\n  time : x\n  host : node-a\n  rank : 0 (local_rank: 0)\n"
        "  exitcode  : 1 (pid: 9)\n"
    )
    watcher = StderrWatcher(stderr, out=io.StringIO())
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out, local_addresses={"127.0.0.1", "10.1.2.1"}) == 1
    first = out.getvalue().splitlines()[0]
    assert first.startswith("error: lost contact with 10.1.2.3: a rank there stopped answering")


def test_min_machines_runs_torchrun_with_a_range_and_keeps_the_global_batch():
    r = recipe(rdzv_backend="c10d", min_machines=1, micro_batch_size=2, gradient_accumulation_steps=2)
    plan = make_plan(r, make_cluster(8, 2, 1, "10.0.0.1", 29500, "cpu"))
    command = plan.commands[1]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert command[command.index("--nnodes") + 1] == "1:2" and command[command.index("--nproc_per_node") + 1] == "4"
    assert command[command.index("--rdzv_endpoint") + 1] == "10.0.0.1:29500"
    assert "is_host=0" in command[command.index("--rdzv_conf") + 1]
    assert plan.min_machines == 1 and plan.global_batch_size == 2 * 2 * 8
    from llmtune.plan.commands import elastic_sizes

    as_dict = plan.to_dict()
    assert elastic_sizes(as_dict, 8) == {}
    assert elastic_sizes(as_dict, 4) == {"world_size": 4, "data_parallel_size": 4, "gradient_accumulation_steps": 4}
    for world in (2, 12):
        with pytest.raises(UserError, match=f"started {world} process"):
            elastic_sizes(as_dict, world)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"min_machines": 1}, "min_machines needs rdzv_backend: c10d"),
        ({"rdzv_backend": "c10d", "min_machines": 3}, "min_machines 3 is more than the 2 machines of the launch"),
        (
            {"rdzv_backend": "c10d", "min_machines": 1, "deepspeed": "zero2"},
            "DeepSpeed ZeRO-2 checkpoints can't follow",
        ),
    ],
)
def test_min_machines_mistakes(changes, message):
    with pytest.raises(UserError, match=message):
        make_plan(recipe(**changes), make_cluster(4, 2, 0, "10.0.0.1", 29500, "cpu"))


def test_min_machines_refuses_a_machine_count_that_breaks_the_global_batch():
    r = recipe(rdzv_backend="c10d", min_machines=2, micro_batch_size=1, gradient_accumulation_steps=1)
    with pytest.raises(UserError, match=r"with 2 machine\(s\) the global batch 3 can't be kept"):
        make_plan(r, make_cluster(3, 3, 0, "10.0.0.1", 29500, "cpu"))
    with pytest.raises(UserError, match=r"with 3 machine\(s\) the global batch 4"):  # 4 x 1: 2 and 3 must divide 4
        make_plan(recipe(rdzv_backend="c10d", min_machines=2), make_cluster(4, 4, 0, "10.0.0.1", 29500, "cpu"))


@pytest.mark.parametrize(
    ("exception", "message"),
    [
        ("RendezvousTimeoutError", "error: the c10d rendezvous at 10.0.0.1:29500 did not gather 2 machine(s) within 30 s"),
        ("RendezvousConnectionError: The connection to the C10d store has failed.",
         "error: could not reach the c10d rendezvous store at 10.0.0.1:29500 (machine rank 0 hosts it; rdzv_timeout 30 s)"),
    ],
)  # fmt: skip
def test_a_c10d_rendezvous_that_cant_form_is_one_line(tmp_path, exception, message):
    stderr = io.StringIO(
        f"Traceback (most recent call last):\n  File x\ntorch.distributed.elastic.rendezvous.api.{exception}\n"
    )
    watcher = StderrWatcher(stderr, out=io.StringIO())
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out, rendezvous=("10.0.0.1:29500", 2, 30)) == 2
    assert out.getvalue().startswith(message) and "Traceback" not in out.getvalue()


def test_a_crash_on_one_machine_is_not_reported_as_a_lost_machine(tmp_path):
    """One machine: rank 0 sees rank 1 (on 127.0.0.1) close its connection; the story is rank 1's own error."""
    stderr = io.StringIO(
        "[rank0]:RuntimeError: Connection closed by peer [127.0.0.1]:4567\nTraceback (most recent call last):\n"
        "Root Cause (first observed failure):\n  host : node-a\n  rank : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 9)\n"
    )
    watcher = StderrWatcher(stderr, out=io.StringIO())
    watcher.run()
    for local in (None, {"127.0.0.1", "10.0.0.1"}):
        out = io.StringIO()
        report(watcher, tmp_path, out, local_addresses=local)
        assert out.getvalue().startswith("error: rank 1 (local rank 1 on node-a) exited with code 1")


def test_the_failure_report_shows_what_the_rank_printed_or_says_it_printed_nothing(tmp_path):
    cause = (
        "Root Cause (first observed failure):\n  host : node-a\n  rank : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 9)\n"
    )
    folder = tmp_path / "run_x" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text("")
    (folder / "stdout.log").write_text("[llmtune] something\nlast words\n")
    shown = []
    for _ in range(2):
        watcher = StderrWatcher(io.StringIO("Traceback (most recent call last):\n" + cause), out=io.StringIO())
        watcher.run()
        out = io.StringIO()
        assert report(watcher, tmp_path, out) == 1
        shown.append(out.getvalue())
        (folder / "stdout.log").write_text("")
    assert f"last lines of rank 1 ({folder / 'stdout.log'}):\n    [llmtune] something\n    last words" in shown[0]
    assert f"rank 1 printed nothing before it stopped (its log: {folder})" in shown[1]


def _report_of(failures: list[tuple[int, int]], root: tuple[int, int]) -> str:
    """torchrun's failure report: the other failures, then the root cause, each as (rank, exit code)."""

    def block(index, rank, code):
        return (f"[{index}]:\n  time      : 2026-11-25_10:39:31\n  host      : node-a\n  rank      : {rank} (local_rank: "
                f"{rank})\n  exitcode  : {code} (pid: 9{rank})\n  error_file: <N/A>\n")  # fmt: skip

    others = "".join(block(i + 1, r, c) for i, (r, c) in enumerate(failures)) or "  <NO_OTHER_FAILURES>\n"
    return (f"Traceback (most recent call last):\nChildFailedError:\n====\nrun FAILED\n----\nFailures:\n{others}----\n"
            f"Root Cause (first observed failure):\n{block(0, *root)}====\n")  # fmt: skip


def test_a_user_error_is_never_blamed_on_the_peer_torchrun_stopped(tmp_path):
    """Rank 0 refused a row (exit 2); rank 1, waiting for it at a barrier, lost the connection and was stopped by
    torchrun (SIGTERM). The user error is the story, not the stopped peer (seen on CI, 1 run in ~11)."""
    error = "error: bad.jsonl line 2: field 'output' should be str, not int (hint: fix the row)"
    stream = (f"[rank0]:{error}\n"
              + _traceback(1, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4001")
              + _report_of([(1, -15)], (0, 2)))  # fmt: skip
    watcher = StderrWatcher(io.StringIO(stream), out=io.StringIO())
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out) == 2
    assert out.getvalue().strip() == error
    # and a rank torchrun stopped with SIGTERM is not "the killed one" when the named rank failed on its own
    stream = ("[rank0]:RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4001\n"
              + _report_of([(1, -15)], (0, 1)))  # fmt: skip
    watcher = StderrWatcher(io.StringIO(stream), out=io.StringIO())
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out) == 1
    assert out.getvalue().startswith("error: rank 0 (local rank 0 on node-a) exited with code 1"), out.getvalue()


@pytest.mark.parametrize(
    ("rank0_line", "failures", "blamed"),
    [
        # rank 1 was SIGKILLed; rank 0 lost its connection and exited in the same poll, and torchrun named it
        ("[rank0]:RuntimeError: [pair.cc:537] Read error [127.0.0.1]:35240: Connection reset by peer.", [(1, -9)],
         "error: rank 1 (local rank 1 on node-a) was killed by signal 9 (SIGKILL)"),
        # the same, in gloo's other wording
        ("[rank0]:RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4567", [(1, -6)],
         "error: rank 1 (local rank 1 on node-a) was killed by signal 6 (SIGABRT)"),
        # rank 0's own error, no lost connection: torchrun's root cause stands
        ("[rank0]:ValueError: bad shape", [(1, -9)], "error: rank 0 (local rank 0 on node-a) exited with code 1"),
        # a lost connection but nobody killed: rank 0 stands
        ("[rank0]:RuntimeError: Read error [127.0.0.1]:35240: Connection reset by peer.", [(1, 1)],
         "error: rank 0 (local rank 0 on node-a) exited with code 1"),
    ],
)  # fmt: skip
def test_a_killed_rank_is_blamed_over_the_peer_that_lost_it(tmp_path, rank0_line, failures, blamed):
    watcher = StderrWatcher(io.StringIO(rank0_line + "\n" + _report_of(failures, (0, 1))), out=io.StringIO())
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out) == 1
    assert out.getvalue().startswith(blamed + "; the other ranks were stopped"), out.getvalue()


def test_gloo_read_errors_name_the_lost_machine(tmp_path):
    line = "[rank0]:RuntimeError: [pair.cc:537] Read error [10.1.2.3]:35240: Connection reset by peer."
    watcher = StderrWatcher(io.StringIO(line + "\n" + _report_of([], (0, 1))), out=io.StringIO())
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out, local_addresses={"127.0.0.1", "10.1.2.1"}) == 1
    assert out.getvalue().startswith("error: lost contact with 10.1.2.3: a rank there stopped answering")


def _traceback(rank: int, last: str) -> str:
    return (f"[rank{rank}]:[rank{rank}]: Traceback (most recent call last):\n"
            f"[rank{rank}]:[rank{rank}]:   File \"x.py\", line 1, in <module>\n[rank{rank}]:[rank{rank}]:     f()\n"
            f"[rank{rank}]:[rank{rank}]: {last}\n")  # fmt: skip


def test_a_peer_traceback_printed_before_the_user_error_stays_out_of_the_console(tmp_path):
    """Ranks print in any order: rank 1's broken-connection traceback can arrive before rank 0's one-line error."""
    error = "error: bad.jsonl line 2: field 'output' should be str, not int (hint: fix the row)"
    stream = (
        "[rank0]:[llmtune] data: reading\n"
        + _traceback(1, "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:35240: Connection reset by peer.")
        + f"[rank0]:{error}\n" + _report_of([(1, 1)], (0, 2))
    )  # fmt: skip
    console = io.StringIO()
    watcher = StderrWatcher(io.StringIO(stream), out=console)
    watcher.run()
    out = io.StringIO()
    assert report(watcher, tmp_path, out) == 2
    assert "Traceback" not in console.getvalue() and "[llmtune] data: reading" in console.getvalue()
    assert out.getvalue() == error + "\n"


def test_a_rank_traceback_of_its_own_error_is_shown_whole():
    stream = "[rank0]:[llmtune] step 1\n" + _traceback(1, "ValueError: shapes differ") + "[rank0]:[llmtune] step 2\n"
    console = io.StringIO()
    StderrWatcher(io.StringIO(stream), out=console).run()
    shown = console.getvalue()
    assert "Traceback (most recent call last):" in shown and "ValueError: shapes differ" in shown
    assert shown.index("ValueError: shapes differ") < shown.index("step 2")


def test_the_advice_after_a_failure_names_the_checkpoint_a_rerun_resumes_from_or_says_it_starts_over(tmp_path):
    """A rank that raised is not told a rerun will fix it; a rerun resumes from the newest complete checkpoint on
    disk, or starts over when there is none (an incomplete one doesn't count)."""
    import json

    from llmtune.launch.failures import next_step

    out = tmp_path / "run"
    logs = out / "llmtune" / "logs"
    logs.mkdir(parents=True)
    (out / "checkpoint-4").mkdir()  # interrupted while saving: no marker
    killed, raised = next_step(logs, -9, True), next_step(logs, 1, True)
    assert killed == f"run the same command again: it starts over (no complete checkpoint in {out} yet)"
    assert raised.startswith("if the error above was a passing fault") and "fix its cause first" in raised
    # resume_from_checkpoint names one elsewhere, and the run saved none yet: a rerun loads that one again (it said
    # "starts over"), and a failure may be that checkpoint's own
    (out / "llmtune" / "plan.json").write_text(json.dumps({"recipe": {"resume_from_checkpoint": "/old/checkpoint-9"}}))
    assert next_step(logs, -9, True) == "run the same command again: it resumes /old/checkpoint-9 again"
    assert "if it came from loading that checkpoint (damaged, or another model's), point resume_from_checkpoint at " \
        "another one or remove it" in next_step(logs, 1, True)  # fmt: skip
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "llmtune-complete.json").write_text("{}")
    assert next_step(logs, -9, True) == ("to resume from the last complete checkpoint, run the same command again "
                                         "(checkpoint-2)")  # fmt: skip
    assert "checkpoint-2" in next_step(logs, 1, True) and "otherwise fix its cause first" in next_step(logs, 1, True)
    # a rerun resumes what `llmtune train` would: the named checkpoint wins over output_dir's newest when that one was
    # saved by a run that started elsewhere (it said checkpoint-2)
    marker = {"started_from": "/elsewhere/checkpoint-1"}
    (out / "checkpoint-2" / "llmtune-complete.json").write_text(json.dumps(marker))
    assert next_step(logs, -9, True) == ("run the same command again: it resumes /old/checkpoint-9 again, as "
                                         f"resume_from_checkpoint says, not checkpoint-2 in {out}")  # fmt: skip
    # auto_resume_from_checkpoints: false and no resume_from_checkpoint: a rerun starts over (it said checkpoint-2)
    (out / "llmtune" / "plan.json").write_text(json.dumps({"recipe": {"auto_resume_from_checkpoints": False}}))
    assert next_step(logs, -9, True) == ("run the same command again: it starts over (auto_resume_from_checkpoints: "
                                         "false; set it to true to resume checkpoint-2)")  # fmt: skip
    assert "it starts over" in next_step(logs, 1, True) and "otherwise fix its cause first" in next_step(logs, 1, True)
    (out / "llmtune" / "plan.json").write_text(json.dumps({"recipe": {}}))
    # several machines: machine 0 may hold the checkpoints, so none is named
    assert "if one was saved" in next_step(logs, -9, False) and "checkpoint-2" not in next_step(logs, -9, False)


def test_flags_train_does_not_know_are_refused_unless_accelerate_launch_takes_them():
    """`llmtune train` hands flags it doesn't know to accelerate launch. A flag neither knows, accelerate's spelling of
    an llmtune option, or any launcher flag where the plan runs python directly was dropped (a mistyped
    `--num_processes 2` trained one process): each is one line now."""
    from llmtune.launch.runner import check_launcher_flags

    ours = ["--num-processes", "--device", "--rehearse"]
    with pytest.raises(UserError, match="--lr is an option of neither llmtune train nor accelerate launch"):
        check_launcher_flags(["--lr", "1"], ours)
    with pytest.raises(UserError, match=r"--num_processes is llmtune's --num-processes") as err:
        check_launcher_flags(["--num_processes=2"], ours)
    assert err.value.hint == "use --num-processes"
    with pytest.raises(UserError, match="--num-proceses is an option of neither") as err:
        check_launcher_flags(["--num-proceses", "2"], ours)
    assert err.value.hint == "did you mean --num-processes?"
    threads = ["--num_cpu_threads_per_process", "4"]
    check_launcher_flags(threads, ours)  # accelerate's: passed on, where the plan launches with it
    check_launcher_flags(threads, ours, ["accelerate", "launch", "--config_file", "c.yaml", "-m", "x"])
    with pytest.raises(UserError, match="this plan runs python directly"):
        check_launcher_flags(threads, ours, ["python", "-m", "llmtune.train", "plan.json"])


@pytest.mark.parametrize(("extra", "said", "hint"), [
    # what the plan decides from the recipe: these crashed every rank or changed the run behind the plan
    (["--config_file", "acc.yaml"], "--config_file: llmtune writes the accelerate config", "deepspeed:"),
    (["--use_fsdp"], "--use_fsdp: FSDP's settings come from the recipe", "fsdp_version: 2"),
    (["--fsdp_sharding_strategy", "FULL_SHARD"], "FSDP's settings come from the recipe", "fsdp_config"),
    (["--mixed_precision", "bf16"], "--mixed_precision: the recipe's bf16/fp16", "bf16: true"),
    (["--gradient_accumulation_steps", "4"], "the recipe sets the batch", "gradient_accumulation_steps in the recipe"),
    (["--zero_stage", "2"], "DeepSpeed's settings come from the recipe", "deepspeed:"),
    (["--rdzv_backend", "c10d"], "the recipe sets the rendezvous", "rdzv_backend: c10d"),
    (["--log_dir", "/tmp/x", "--tee", "0"], "--log_dir: llmtune sets it", "remove it"),
    (["-m", "mymod"], "-m: llmtune runs its own training module", "remove it"),
    # torchrun's spellings of llmtune's options (--nnodes was answered 'did you mean --no-ssh?')
    (["--nnodes", "2"], "--nnodes is torchrun's", "use --num-machines"),
    (["--nproc_per_node", "2"], "--nproc_per_node is torchrun's", "use --num-processes"),
    (["--rdzv_endpoint", "10.0.0.1:29400"], "c10d's endpoint", "use --main-process-ip"),
    # a word that is not a flag was accelerate's training script, run as Python on every rank
    (["other.yaml"], "unexpected argument 'other.yaml': llmtune train takes one recipe", "pass one recipe"),
    (["--", "train.py"], "unexpected argument 'train.py'", "pass one recipe"),
    (["--num_cpu_threads_per_process", "4", "x.yaml"], "unexpected argument 'x.yaml'", "pass one recipe"),
])  # fmt: skip
def test_launcher_flags_that_set_what_the_recipe_plans_and_stray_words_are_one_line(extra, said, hint):
    from llmtune.launch.runner import check_launcher_flags

    with pytest.raises(UserError, match=re.escape(said)) as refused:
        check_launcher_flags(extra, ["--num-processes", "--num-machines", "--main-process-ip", "--rdzv-endpoint"])
    assert hint in refused.value.hint


def test_a_launchers_variables_inherited_from_the_shell_are_refused(monkeypatch):
    """WORLD_SIZE=4 inherited made one process say 'the launcher started 4'; RANK=1 alone a traceback from torch."""
    from llmtune.launch.flags import check_inherited_environment

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    check_inherited_environment()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(UserError, match="WORLD_SIZE=4, RANK=1 are set in the environment") as refused:
        check_inherited_environment()
    assert refused.value.hint.startswith("unset WORLD_SIZE RANK;")


def test_device_cuda_without_a_usable_gpu_is_one_line(monkeypatch):
    """Every rank divided its local rank by a GPU count of 0 (ZeroDivisionError), with 'run it again' advice."""
    import torch

    from llmtune.launch.flags import check_cuda_usable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    check_cuda_usable("cpu")
    with pytest.raises(UserError, match=r"torch sees no usable GPU on this machine \(CUDA_VISIBLE_DEVICES=0,1\)"):
        check_cuda_usable("cuda")


def test_a_ranks_user_error_is_said_once_last_even_when_torchrun_names_the_peer(tmp_path):
    error = "error: lora_target_modules: 'o_prj' names no module of this model (llama) (hint: ...)"
    console = io.StringIO()
    for root in ((0, 2), (1, 1)):  # the erring rank named, or the peer that lost its connection to it
        stream = (f"[rank0]:{error}\n[rank1]:{error}\n"
                  + _traceback(1, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4001")
                  + _report_of([(1 - root[0], 2 if root[0] else 1)], root))  # fmt: skip
        watcher = StderrWatcher(io.StringIO(stream), out=console)
        watcher.run()
        out = io.StringIO()
        assert report(watcher, tmp_path, out) == 2
        assert out.getvalue() == error + "\n"
    assert error not in console.getvalue()  # not shown as it came: only the report's line


@pytest.mark.parametrize(("args", "said"), [
    # accelerate's and torchrun's spellings of an option the command has: click's four lines named neither
    (["plan", "{recipe}", "--num_processes", "2"], "--num_processes is spelled --num-processes in llmtune plan "
                                                   "(hint: use --num-processes)"),
    (["validate", "{recipe}", "--nnodes", "2"], "--nnodes is torchrun's (or DeepSpeed's launcher's); llmtune validate "
                                                "takes --num-machines (hint: use --num-machines)"),
    (["estimate", "{recipe}", "--num-processes", "8"], "it counts GPUs per machine (hint: use --gpus-per-machine"),
    (["plan", "{recipe}", "--num-proceses", "2"], "llmtune plan has no option --num-proceses (hint: did you mean "
                                                  "--num-processes?)"),
    (["plan", "{recipe}", "--frobnicate"], "llmtune plan has no option --frobnicate (hint: see llmtune plan --help)"),
    (["plan"], "Missing argument 'recipe' (hint: see llmtune plan --help)"),
    (["plan", "{recipe}", "--num-processes", "x"], "Invalid value for '--num-processes'"),
    # rehearse takes launcher flags as train does, and refuses the same ones before building anything
    (["rehearse", "{recipe}", "--num_processes", "2"], "--num_processes is llmtune's --num-processes"),
    (["rehearse", "{recipe}", "--lr", "1"], "--lr is an option of neither llmtune rehearse nor accelerate launch"),
])  # fmt: skip
def test_a_command_line_the_command_cannot_take_is_one_line_exit_2(run_cli, write_recipe, tmp_path, args, said):
    recipe = write_recipe({"output_dir": str(tmp_path / "out")})
    result = run_cli(*[str(recipe) if arg == "{recipe}" else arg for arg in args])
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], result.err
    assert "Usage:" not in result.err and "Traceback" not in result.err
    assert not (tmp_path / "out").exists()  # nothing written
