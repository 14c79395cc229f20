"""The vLLM server of a GRPO recipe in server mode (trl.use_vllm, trl.vllm_mode: server): `llmtune vllm-serve
RECIPE` starts TRL's server with the recipe's vllm: section; `llmtune train` waits for it before starting the
ranks, and says so in one line when it never answers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import urllib.error
import urllib.request

from llmtune.errors import UserError
from llmtune.plan.generation import server_address


def wait_for(recipe, recipe_path: str, log) -> None:
    """Until the server answers /health, within trl.vllm_server_timeout (TRL's default 240 s)."""
    from llmtune.recipe.online import trl_value

    host, port = server_address(recipe)
    timeout = float(trl_value(recipe, "vllm_server_timeout", 240))
    log(f"waiting up to {timeout:.0f} s for the vLLM server at {host}:{port}")
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health/", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as err:
            last = str(getattr(err, "reason", err))
        time.sleep(2)
    raise UserError(f"the vLLM server at {host}:{port} did not answer within {timeout:.0f} s "
                    f"(trl.vllm_server_timeout): {last}",
                    f"start it first on GPUs the training doesn't use: llmtune vllm-serve {recipe_path}")  # fmt: skip


def serve(recipe, recipe_path: str) -> int:
    """Run TRL's vLLM server in the foreground (Ctrl-C stops it)."""
    from llmtune.plan.generation import serve_command
    from llmtune.recipe.online import generation_mode

    if recipe.rl not in ("grpo", "gdpo") or generation_mode(recipe) != "server":
        raise UserError(f"{recipe_path} generates {generation_mode(recipe) if recipe.rl else 'nothing'}: "
                        "llmtune vllm-serve is for rl: grpo/gdpo with trl.use_vllm: true and trl.vllm_mode: server",
                        "colocated and in-process generation need no server")  # fmt: skip
    if importlib.util.find_spec("vllm") is None:
        raise UserError("vLLM is not installed here", "pip install 'llmtune[vllm]' (on the machine with the GPUs)")
    command = serve_command(recipe, recipe_path)
    argv = [sys.executable, "-c", "import sys; from trl.cli import main; sys.argv[0] = 'trl'; main()", *command[1:]]
    print(f"[llmtune] {' '.join(command)}", file=sys.stderr, flush=True)
    return subprocess.call(argv)
