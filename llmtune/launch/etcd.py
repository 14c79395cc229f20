"""rdzv_backend: etcd: the etcd server that holds torchrun's elastic rendezvous, off the training machines.

Before torchrun starts, each machine's launcher
- checks that the server answers and serves the v2 API (torch's etcd-v2 backend speaks it), and that python-etcd,
  which that backend imports, is installed: one line naming the endpoint otherwise, exit 2;
- agrees with the other machines, through etcd itself, on the launch's rendezvous id. A torch rendezvous, once a job
  using it ends (finished or failed), is closed for good, so a rerun of the same command needs a fresh id while
  machines started for the same launch need the same one: the job's id (from its output folder) and a generation
  number kept in etcd, moved on (compare-and-swap: one machine wins) when a launcher of that generation saw its job
  end.

Only the standard library here (urllib): the launcher stays light; torch's backend in torchrun imports python-etcd.
"""

from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.parse
import urllib.request

from llmtune.errors import UserError

PREFIX = "/v2/keys/llmtune/rendezvous"
HOW_TO_RUN = ("start it off the training machines with Debian's etcd-server: etcd --enable-v2=true "
              "--listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://<its address>:2379")  # fmt: skip


def _request(endpoint: str, path: str, method: str = "GET", form: dict | None = None, timeout: float = 10):
    """(status, parsed JSON or None) of one v2 API call."""
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(f"http://{endpoint}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except ValueError:
            return err.code, None


def check(endpoint: str, timeout: float = 10) -> str:
    """The server's version; one-line UserErrors for what would make torchrun hang or fail later."""
    if importlib.util.find_spec("etcd") is None:
        raise UserError("rdzv_backend: etcd needs python-etcd on every machine (torch's etcd-v2 backend imports it)",
                        "pip install 'llmtune[etcd]'")  # fmt: skip
    try:
        status, version = _request(endpoint, "/version", timeout=timeout)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise UserError(f"the etcd server at {endpoint} (rdzv_endpoint) does not answer: {reason}",
                        f"check the address and that etcd runs there; {HOW_TO_RUN}") from None  # fmt: skip
    if status != 200 or not isinstance(version, dict) or "etcdserver" not in version:
        raise UserError(f"{endpoint} (rdzv_endpoint) answered, but not as an etcd server (HTTP {status})",
                        "give the etcd server's client address (port 2379 by default)")  # fmt: skip
    status, _ = _request(endpoint, "/v2/keys/", timeout=timeout)
    if status != 200:
        raise UserError(f"the etcd server at {endpoint} (etcd {version['etcdserver']}) does not serve the v2 API, "
                        "which torch's etcd-v2 rendezvous uses", "restart etcd with --enable-v2=true")  # fmt: skip
    return version["etcdserver"]


def generation(endpoint: str, job: str) -> int:
    """This launch's generation of the job's rendezvous: the current one, or the next once the current has ended."""
    key = f"{PREFIX}/{job}/generation"
    for _ in range(20):  # each retry follows another machine's move; a handful settles it
        status, body = _request(endpoint, key)
        if status == 404:
            status, _ = _request(endpoint, key + "?prevExist=false", "PUT", {"value": "0"})
            continue  # created here (201) or by another machine (412): read it again
        current = int(body["node"]["value"])
        ended, _ = _request(endpoint, f"{PREFIX}/{job}/ended/{current}")
        if ended != 200:
            return current
        _request(endpoint, f"{key}?prevValue={current}", "PUT", {"value": str(current + 1)})  # one machine wins
    raise UserError(f"could not agree on a rendezvous generation in etcd at {endpoint}",
                    "is another job using the same output_dir? give each job its own")  # fmt: skip


def mark_ended(endpoint: str, job: str, current: int) -> None:
    """The job of this generation ended on this machine (finished, failed or stopped): the next launch moves on.
    Best effort: an etcd gone by now only means the next launch finds the generation still open."""
    try:
        _request(endpoint, f"{PREFIX}/{job}/ended/{current}", "PUT", {"value": "1"})
    except (urllib.error.URLError, OSError):
        pass


def with_rdzv_id(command: list[str], suffix: str) -> list[str]:
    """The command with `-<suffix>` appended to its --rdzv_id."""
    out = list(command)
    at = out.index("--rdzv_id") + 1
    out[at] = f"{out[at]}-{suffix}"
    return out
