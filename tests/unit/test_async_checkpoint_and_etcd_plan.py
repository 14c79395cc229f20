"""What the plan says and refuses for async_checkpoint and rdzv_backend: etcd (issue 37), and the etcd helpers that
need no server: the run id every machine derives alike, the generation agreed through etcd (against a fake v2 API),
and one-line refusals."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.peak import estimate
from llmtune.recipe.loader import recipe_from_mapping


def recipe(**changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def cluster(machines: int = 1, processes: int = 2, device: str = "cuda"):
    return make_cluster(processes, num_machines=machines, main_process_ip="10.0.0.1" if machines > 1 else None,
                        main_process_port=29500, device=device)  # fmt: skip


# --- async_checkpoint --------------------------------------------------------------------------------------------


def test_async_checkpoint_is_planned_where_torchs_distributed_checkpoint_saves_it():
    for keys in ({}, {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}):
        plan = make_plan(recipe(async_checkpoint=True, **keys), cluster())
        assert any(note.startswith("async_checkpoint: each checkpoint's model and optimizer states are copied to "
                                   "pinned host memory") for note in plan.notes), plan.notes  # fmt: skip
    no_save = make_plan(recipe(async_checkpoint=True, save_strategy="no"), cluster())
    assert "async_checkpoint: no effect (save_strategy: no)" in no_save.notes


@pytest.mark.parametrize(("keys", "words"), [
    ({"deepspeed": "zero2"}, "DeepSpeed writes ZeRO checkpoints itself"),
    ({"fsdp_version": 1, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}, "FSDP1's sharded checkpoints"),
    ({"pipeline_parallel_size": 2}, "pipeline stages checkpoint in llmtune's own loop"),
    ({"early_stopping_patience": 2, "val_set_size": 0.1}, "keeping the best checkpoint reloads it"),
])  # fmt: skip
def test_async_checkpoint_is_refused_in_one_line_where_it_cant_run(keys, words):
    with pytest.raises(UserError, match=words) as caught:
        make_plan(recipe(async_checkpoint=True, **keys), cluster())
    assert "async_checkpoint" in str(caught.value) and "\n" not in str(caught.value)


def test_the_estimate_counts_the_staging_copy_in_host_memory():
    facts = ModelFacts(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_layers=22, num_heads=32, num_kv_heads=4, tie_word_embeddings=False)  # fmt: skip
    plain = {r.name: r for r in estimate(recipe(bf16=True), facts, 2, 2)}
    staged = {r.name: r for r in estimate(recipe(bf16=True, async_checkpoint=True), facts, 2, 2)}
    for name in ("single / DDP", "FSDP full shard"):
        row = staged[name]
        assert row.staging == pytest.approx(row.params + row.optimizer)  # a full fine-tune: every state is copied
        assert row.cpu == pytest.approx(plain[name].cpu + 2 * row.staging)  # two ranks per machine
    assert staged["ZeRO-3"].staging == 0  # refused there: nothing staged
    lora = {r.name: r for r in estimate(recipe(bf16=True, async_checkpoint=True, adapter="lora",
                                               lora_target_linear=True), facts, 2, 2)}  # fmt: skip
    assert lora["single / DDP"].staging < lora["single / DDP"].params / 10  # the adapter's states only


# --- rdzv_backend: etcd ------------------------------------------------------------------------------------------


def test_etcd_runs_torchruns_elastic_agent_against_the_endpoint_and_says_what_it_survives():
    plan = make_plan(recipe(rdzv_backend="etcd", rdzv_endpoint="10.0.0.9:2379", min_machines=1, max_restarts=1),
                     cluster(machines=2))  # fmt: skip
    command = plan.commands[1]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    at = {flag: command[command.index(flag) + 1] for flag in ("--nnodes", "--rdzv_backend", "--rdzv_endpoint",
                                                              "--rdzv_id", "--max_restarts")}  # fmt: skip
    assert at == {"--nnodes": "1:2", "--rdzv_backend": "etcd-v2", "--rdzv_endpoint": "10.0.0.9:2379",
                  "--rdzv_id": plan.commands[0][plan.commands[0].index("--rdzv_id") + 1], "--max_restarts": "1"}  # fmt: skip
    assert at["--rdzv_id"].startswith("llmtune-")  # the same on every machine: from the output folder
    assert any("etcd at 10.0.0.9:2379" in note and "machine 0 included" in note for note in plan.notes)
    c10d = make_plan(recipe(rdzv_backend="c10d"), cluster(machines=2))
    assert any("losing machine 0 ends the job" in note for note in c10d.notes)


@pytest.mark.parametrize(("keys", "machines", "words"), [
    ({"rdzv_backend": "etcd"}, 2, "rdzv_backend: etcd needs rdzv_endpoint"),
    ({"rdzv_backend": "etcd", "rdzv_endpoint": "h:2379"}, 1, "is for jobs on several machines"),
    ({"rdzv_backend": "etcd", "rdzv_endpoint": "h:2379", "fsdp_version": 2}, 2, "with DDP ranks only"),
])  # fmt: skip
def test_etcd_plans_it_cant_run_are_one_line(keys, machines, words):
    with pytest.raises(UserError, match=words):
        make_plan(recipe(**keys), cluster(machines=machines))


def test_endpoint_keys_are_checked_where_they_are_written():
    with pytest.raises(UserError, match="is not host:port"):
        recipe(rdzv_backend="etcd", rdzv_endpoint="nohost")
    with pytest.raises(UserError, match="rdzv_endpoint is the etcd server of rdzv_backend: etcd"):
        recipe(rdzv_endpoint="h:2379")


class FakeEtcd(BaseHTTPRequestHandler):
    """The v2 keys API's few calls llmtune makes: GET, PUT with prevExist=false / prevValue."""

    keys: dict[str, str] = {}

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = urlparse(self.path).path
        if path == "/version":
            return self._reply(200, {"etcdserver": "3.4.23", "etcdcluster": "3.4.0"})
        if path == "/v2/keys/":
            return self._reply(200, {"action": "get", "node": {"dir": True}})
        if path in self.keys:
            return self._reply(200, {"action": "get", "node": {"key": path, "value": self.keys[path]}})
        return self._reply(404, {"errorCode": 100})

    def do_PUT(self):
        url = urlparse(self.path)
        query = parse_qs(url.query)
        value = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())["value"][0]
        if query.get("prevExist") == ["false"] and url.path in self.keys:
            return self._reply(412, {"errorCode": 105})
        if "prevValue" in query and self.keys.get(url.path) != query["prevValue"][0]:
            return self._reply(412, {"errorCode": 101})
        self.keys[url.path] = value
        return self._reply(201, {"action": "set"})


@pytest.fixture
def fake_etcd():
    FakeEtcd.keys = {}
    server = HTTPServer(("127.0.0.1", 0), FakeEtcd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()


def test_machines_of_one_launch_share_a_generation_and_a_rerun_after_the_end_takes_the_next(fake_etcd):
    from llmtune.launch import etcd

    assert etcd.check(fake_etcd) == "3.4.23"
    first = [etcd.generation(fake_etcd, "llmtune-job") for _ in range(2)]  # two machines of the same launch
    assert first == [0, 0]
    etcd.mark_ended(fake_etcd, "llmtune-job", 0)  # the job of generation 0 ended on some machine
    assert [etcd.generation(fake_etcd, "llmtune-job") for _ in range(2)] == [1, 1]
    assert etcd.generation(fake_etcd, "llmtune-other") == 0  # another job's rendezvous is its own
    command = ["python", "-m", "torch.distributed.run", "--rdzv_id", "llmtune-job", "-m", "llmtune.train"]
    assert etcd.with_rdzv_id(command, "1")[4] == "llmtune-job-1"


def test_an_etcd_that_is_not_there_or_not_etcd_is_one_line(fake_etcd):
    from llmtune.launch import etcd
    from llmtune.launch.net import free_port

    nowhere = f"127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=f"the etcd server at {nowhere} \\(rdzv_endpoint\\) does not answer"):
        etcd.check(nowhere, timeout=2)
