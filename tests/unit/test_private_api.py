"""Every private API and monkeypatch llmtune uses on another library, checked against the installed version.

docs/private-api.md lists them; each row's id has a test here named after it (`trainer-save-checkpoint` ->
test_trainer_save_checkpoint) that fails, naming the library, the symbol and the doc, when the library changes
underneath: the symbol is gone, its signature no longer takes what llmtune passes, or the library's public path no
longer calls the method llmtune overrides. Two more tests keep the doc complete: a scan of llmtune/ for private
uses (each must have a row), and a check that llmtune's own private names on subclasses of library classes don't
shadow the library's.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "private-api.md"


def expect(ok: bool, entry: str, library: str, symbol: str, detail: str) -> None:
    """Fail in one readable paragraph: what changed in which library, and where llmtune's use is described."""
    if not ok:
        pytest.fail(f"{library} changed under llmtune: {symbol} {detail}. llmtune relies on it: see "
                    f"docs/private-api.md, entry `{entry}`, for where and why, and what to change.", pytrace=False)  # fmt: skip


def expect_params(entry: str, library: str, function, names: list[str]) -> None:
    """`function` still takes these parameter names (the ones llmtune passes or receives), in this order."""
    symbol = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
    try:
        found = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        found = None
    expect(found is not None and [n for n in found if n in names] == names, entry, library, symbol,
           f"now takes {found}, where llmtune needs {names}")  # fmt: skip


def source_of(entry: str, library: str, obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        expect(False, entry, library, str(obj), "has no readable source to check")
        return ""


def imported(entry: str, library: str, module: str, name: str | None = None):
    try:
        found = importlib.import_module(module)
        return getattr(found, name) if name else found
    except (ImportError, AttributeError) as err:
        expect(False, entry, library, f"{module}.{name}" if name else module, f"can't be imported ({err})")


# --- the doc: every inventoried row has a test here -------------------------------------------------------------


def inventory_ids() -> list[str]:
    """The ids of the rows of the doc's inventory tables: first cell `like-this`."""
    return re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), flags=re.MULTILINE)


def test_every_inventory_entry_has_a_test():
    ids = inventory_ids()
    assert len(ids) >= 20, f"docs/private-api.md lists only {len(ids)} entries; the table format may have changed"
    tests = {name for name in globals() if name.startswith("test_")}
    missing = [i for i in ids if "test_" + i.replace("-", "_") not in tests]
    assert not missing, f"docs/private-api.md entries without a test in {Path(__file__).name}: {missing}"
    assert len(set(ids)) == len(ids), "docs/private-api.md has duplicate entry ids"


# --- the scan: a private use in llmtune/ without a row in the doc fails -------------------------------------------

PRIVATE = re.compile(r"^_[A-Za-z0-9]")  # _name, not __dunder__
CHECKERS = {"getattr", "hasattr", "setattr", "delattr"}


def sources() -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(ROOT)), ast.parse(p.read_text(), str(p))) for p in sorted((ROOT / "llmtune").rglob("*.py"))
    ]


def owned_names(trees) -> set[str]:
    """Private names llmtune defines itself: functions, classes, assigned names, and attributes set on self/cls.
    (A self attribute a library also uses is caught by the shadowing test below, not here.)"""
    names = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                    elif isinstance(target, ast.Attribute) and ast.unparse(target.value) in ("self", "cls"):
                        names.add(target.attr)
    return {n for n in names if PRIVATE.match(n)}


def private_uses(path: str, tree: ast.Module, owned: set[str]) -> set[tuple[str, str]]:
    """(file, token) for each private import, private attribute, monkeypatching assignment and setattr."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in ("llmtune",
                                                                                                      "__future__"):  # fmt: skip
            found |= {(path, p) for p in node.module.split(".") if PRIVATE.match(p)}
            found |= {(path, a.name) for a in node.names if PRIVATE.match(a.name)}
        elif isinstance(node, ast.Import):
            found |= {(path, p) for a in node.names for p in a.name.split(".") if PRIVATE.match(p)}
        elif isinstance(node, ast.Attribute) and PRIVATE.match(node.attr) and node.attr not in owned:
            found.add((path, node.attr))
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in CHECKERS or name == "get":
                found |= {(path, a.value) for a in node.args if isinstance(a, ast.Constant)
                          and isinstance(a.value, str) and PRIVATE.match(a.value) and a.value not in owned}  # fmt: skip
            if name == "setattr" and node.args and ast.unparse(node.args[0]) not in ("self", "cls"):
                found.add((path, "setattr"))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
                    found.add((path, "sys.modules"))
                elif (
                    isinstance(target, ast.Attribute)
                    and ast.unparse(target.value) not in ("self", "cls")
                    and (target.attr == "forward" or (target.attr.startswith("__") and target.attr.endswith("__")))
                ):
                    found.add((path, target.attr))  # a class's method, an instance's class or forward replaced
    return found


def table_rows(exclude: str) -> list[str]:
    """The doc's table rows, except those under a heading that starts with `exclude`."""
    rows, skipping = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            skipping = line.lstrip("# ").startswith(exclude)
        elif line.startswith("|") and not skipping:
            rows.append(line)
    return rows


def listed(path: str, token: str, rows: list[str]) -> bool:
    word = re.compile(rf"(?<![\w]){re.escape(token)}(?![\w])")
    return any(path in row and word.search(row) for row in rows)


def test_every_private_use_in_llmtune_is_listed_in_the_doc():
    trees = sources()
    owned = owned_names(trees)
    rows = table_rows(exclude="Replaced")  # a replaced use is no longer allowed back in without a row of its own
    uses = set().union(*(private_uses(path, tree, owned) for path, tree in trees))
    assert len(uses) >= 10, f"the scan found only {sorted(uses)}: it has stopped seeing what it should"
    missing = sorted(f"{path}: {token}" for path, token in uses if not listed(path, token, rows))
    assert not missing, ("private third-party uses (or monkeypatches) in llmtune/ with no row in docs/private-api.md "
                         "naming both the file and the symbol; add one (where, what, why, versions, what breaks) and "
                         f"a test here: {missing}")  # fmt: skip


def test_the_scan_tells_llmtunes_own_private_names_from_a_librarys():
    code = ("import torch\nfrom torch._x import y\nfrom llmtune.a import _mine\nclass C:\n    def _own(self):\n"
            "        self._flag = 1\n        self._own(); torch._C._foo(); item._is_x = 0\n"
            "        Klass.__init__ = f; sys.modules['a'] = None; setattr(obj, 'k', 1); hasattr(obj, '_probe')\n")  # fmt: skip
    tree = ast.parse(code)
    found = {t for _, t in private_uses("f.py", tree, owned_names([("f.py", tree)]))}
    assert found == {"_x", "_C", "_foo", "_is_x", "__init__", "sys.modules", "setattr", "_probe"}


# --- llmtune's own private names must not shadow a library's ------------------------------------------------------

# The overrides and flags that do so on purpose; each has a row in the doc.
MEANT = {"_save_checkpoint", "_get_output_dir", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
         "_created_lr_scheduler", "_load_rng_state", "_get_learning_rate"}  # fmt: skip


def subclass_private_names(tree: ast.ClassDef) -> set[str]:
    """The private names a class's own source defines: methods, class attributes, attributes set on self."""
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in tree.body:
        for target in node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]:
            if isinstance(target, ast.Name):
                names.add(target.id)
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self"}  # fmt: skip
    return {n for n in names if PRIVATE.match(n)}


def test_llmtune_private_names_on_library_subclasses_do_not_shadow_the_librarys():
    """A subclass's `_name` that its library base also defines (or sets on self) silently replaces the library's."""
    from llmtune.train.model.qat import _pausable_mx

    classes = [_pausable_mx()]  # built inside a function (torchao is imported only when MX QAT is asked for)
    for path, tree in sources():
        module = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        defined = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.bases]
        if defined and not module.endswith("__main__"):
            classes += [getattr(importlib.import_module(module), name) for name in defined]
    clashes, checked = [], 0
    for cls in classes:
        bases = [b for b in cls.__mro__[1:] if not b.__module__.startswith(("llmtune", "builtins"))]
        if not bases:
            continue
        names = subclass_private_names(ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0])
        base_sources = "\n".join(inspect.getsource(sys.modules[b.__module__]) for b in bases)
        for name in sorted(names - MEANT):
            checked += 1
            if any(name in vars(b) for b in bases) or re.search(rf"self\.{name}\b", base_sources):
                clashes.append(f"{cls.__qualname__}.{name} (also in {bases[0].__module__}.{bases[0].__qualname__})")
    assert checked >= 10, f"only {checked} private names checked: the class list is stale"
    rows = table_rows(exclude="Replaced")
    assert all(any(listed("llmtune/", name, [row]) for row in rows) for name in MEANT), "MEANT names need doc rows"
    assert not clashes, ("llmtune defines private names its library base class also uses: rename them, or, if the "
                         f"override is meant, add a row to docs/private-api.md and a test here: {clashes}")  # fmt: skip


# --- transformers: the Trainer's private methods llmtune overrides or calls ----------------------------------------


@pytest.fixture(scope="module")
def trainer_calls(tmp_path_factory):
    """A tiny Trainer run through the public train(): two steps with a checkpoint each, train() again on the same
    Trainer, then a resume from checkpoint-1. Records which private methods the Trainer called, with what."""
    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x, labels):
            return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

    calls: list[tuple] = []

    class Recording(Trainer):  # each override records and defers to the Trainer, as llmtune's do
        def _get_output_dir(self, trial):
            folder = super()._get_output_dir(trial)
            calls.append(("_get_output_dir", folder))
            return folder

        def _save_checkpoint(self, model, trial):
            calls.append(("_save_checkpoint", self.state.global_step))
            return super()._save_checkpoint(model, trial)

        def _save_rng_state(self, output_dir):
            calls.append(("_save_rng_state", output_dir))
            return super()._save_rng_state(output_dir)

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            calls.append(("_load_from_checkpoint", resume_from_checkpoint))
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

        def _load_optimizer_and_scheduler(self, checkpoint):
            calls.append(("_load_optimizer_and_scheduler", checkpoint))
            return super()._load_optimizer_and_scheduler(checkpoint)

        def _load_rng_state(self, checkpoint):
            calls.append(("_load_rng_state", checkpoint))
            return super()._load_rng_state(checkpoint)

        def _get_learning_rate(self):
            calls.append(("_get_learning_rate", self.state.global_step))
            return super()._get_learning_rate()

        def create_scheduler(self, num_training_steps, optimizer=None):  # as LlmtuneTrainer's quadratic warmup
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lambda _: 1.0)
                self._created_lr_scheduler = True
                calls.append(("own_scheduler", self.lr_scheduler))
            return super().create_scheduler(num_training_steps, optimizer)

    torch.manual_seed(0)
    rows = [{"x": torch.randn(4), "labels": torch.tensor(0.5)} for _ in range(8)]
    out = tmp_path_factory.mktemp("trainer")

    def trainer(steps: int) -> Trainer:
        args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=1, save_strategy="steps",
                                 per_device_train_batch_size=2, report_to=[], use_cpu=True, disable_tqdm=True,
                                 logging_strategy="no")  # fmt: skip
        return Recording(model=Tiny(), args=args, train_dataset=rows)

    first = trainer(2)
    first.train()
    first_run = list(calls)
    first.train()  # a second train() (auto_find_batch_size retries the inner loop the same way)
    again = calls[len(first_run) :]
    calls.clear()
    trainer(3).train(resume_from_checkpoint=str(out / "checkpoint-1"))
    return {"out": out, "first": first_run, "again": again, "resume": list(calls)}


def test_trainer_save_checkpoint(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-save-checkpoint", "transformers", Trainer._save_checkpoint, ["self", "model", "trial"])
    saved = [step for name, step in trainer_calls["first"] if name == "_save_checkpoint"]
    expect(saved == [1, 2], "trainer-save-checkpoint", "transformers", "Trainer._save_checkpoint",
           f"is no longer called by Trainer.train() at each save step (called at steps {saved}, expected [1, 2])")  # fmt: skip


def test_trainer_get_learning_rate(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-get-learning-rate", "transformers", Trainer._get_learning_rate, ["self"])
    asked = [step for name, step in trainer_calls["first"] if name == "_get_learning_rate"]
    expect(asked[:2] == [0, 1], "trainer-get-learning-rate", "transformers", "Trainer._get_learning_rate",
           f"is no longer what Trainer.train() reads the logged rate from at each step (asked at steps {asked})")  # fmt: skip


def test_trainer_get_output_dir(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-get-output-dir", "transformers", Trainer._get_output_dir, ["self", "trial"])
    order = [name for name, _ in trainer_calls["first"] if name != "own_scheduler"]
    inside = (
        order[order.index("_save_checkpoint") + 1 : order.index("_save_rng_state")]
        if "_save_rng_state" in order
        else []
    )
    expect("_get_output_dir" in inside, "trainer-get-output-dir", "transformers", "Trainer._get_output_dir",
           f"is no longer asked for the run folder by Trainer._save_checkpoint (calls: {order}); llmtune's staging "
           "folder would be ignored and checkpoints written in place")  # fmt: skip


def test_trainer_save_rng_state(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-save-rng-state", "transformers", Trainer._save_rng_state, ["self", "output_dir"])
    folders = [Path(f) for name, f in trainer_calls["first"] if name == "_save_rng_state"]
    runs = {Path(f) for name, f in trainer_calls["first"] if name == "_get_output_dir"}
    ok = bool(folders) and all(f.parent in runs and (f / "rng_state.pth").is_file() for f in folders)
    expect(ok, "trainer-save-rng-state", "transformers", "Trainer._save_rng_state",
           f"no longer writes rng_state.pth into <_get_output_dir()>/checkpoint-N (wrote {folders})")  # fmt: skip
    source = source_of("trainer-save-rng-state", "transformers", Trainer._load_rng_state)
    expect("rng_state" in source, "trainer-save-rng-state", "transformers", "Trainer._load_rng_state",
           "no longer reads the rng_state files _save_rng_state writes")  # fmt: skip


def test_trainer_load_from_checkpoint(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-load-from-checkpoint", "transformers", Trainer._load_from_checkpoint,
                  ["self", "resume_from_checkpoint", "model"])  # fmt: skip
    loaded = [f for name, f in trainer_calls["resume"] if name == "_load_from_checkpoint"]
    expect(loaded == [str(trainer_calls["out"] / "checkpoint-1")], "trainer-load-from-checkpoint", "transformers",
           "Trainer._load_from_checkpoint", f"is not called by train(resume_from_checkpoint=...) (calls: {loaded})")  # fmt: skip
    source = source_of("trainer-load-from-checkpoint", "transformers", Trainer)
    expect(source.count("self._load_from_checkpoint(") >= 2, "trainer-load-from-checkpoint", "transformers",
           "Trainer._load_from_checkpoint", "is no longer called on the FSDP/DeepSpeed resume path as well")  # fmt: skip


def test_trainer_load_optimizer_and_scheduler(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-load-optimizer-and-scheduler", "transformers", Trainer._load_optimizer_and_scheduler,
                  ["self", "checkpoint"])  # fmt: skip
    loaded = [f for name, f in trainer_calls["resume"] if name == "_load_optimizer_and_scheduler"]
    expect(loaded == [str(trainer_calls["out"] / "checkpoint-1")], "trainer-load-optimizer-and-scheduler",
           "transformers", "Trainer._load_optimizer_and_scheduler",
           f"is not called by train(resume_from_checkpoint=...) (calls: {loaded})")  # fmt: skip


def test_trainer_created_lr_scheduler(trainer_calls):
    first = [s for name, s in trainer_calls["first"] if name == "own_scheduler"]
    again = [s for name, s in trainer_calls["again"] if name == "own_scheduler"]
    expect(len(first) == 1 and len(again) == 1 and again[0] is not first[0], "trainer-created-lr-scheduler",
           "transformers", "Trainer._created_lr_scheduler",
           "no longer makes the Trainer drop a scheduler its create_scheduler made when train() runs the inner loop "
           "again: llmtune's own schedule would stay bound to the old optimizer")  # fmt: skip


# --- transformers: model loading ----------------------------------------------------------------------------------


def test_model_is_hf_initialized(tmp_path):
    import torch
    from tiny import make_tiny_model
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.load import reinitialise

    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_model(tmp_path / "m", layers=1, hidden=32)))
    flagged = [n for n, p in model.named_parameters() if getattr(p, "_is_hf_initialized", False)]
    expect(bool(flagged), "model-is-hf-initialized", "transformers", "`_is_hf_initialized`",
           "is no longer set on loaded parameters by from_pretrained")  # fmt: skip
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    model.init_weights()
    kept = all(torch.equal(loaded[n], p) for n, p in model.named_parameters())
    expect(kept, "model-is-hf-initialized", "transformers", "PreTrainedModel.init_weights",
           "now re-draws loaded weights by itself; llmtune's reset of `_is_hf_initialized` may be unneeded")  # fmt: skip
    reinitialise(model, lambda _line: None)
    changed = [n for n, p in model.named_parameters() if p.dim() > 1 and not torch.equal(loaded[n], p)]
    expect(len(changed) == sum(p.dim() > 1 for p in model.parameters()), "model-is-hf-initialized", "transformers",
           "`_is_hf_initialized`", f"no longer gates init_weights: reinit_weights left weights as loaded "
           f"(re-drawn: {changed})")  # fmt: skip


def tiny_llama4_config():
    from transformers import Llama4TextConfig

    return Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1)  # fmt: skip


def test_llama4_moe_init():
    modeling = imported("llama4-moe-init", "transformers", "transformers.models.llama4.modeling_llama4")
    moe = getattr(modeling, "Llama4TextMoe", None)
    expect(moe is not None, "llama4-moe-init", "transformers", "modeling_llama4.Llama4TextMoe", "is gone")
    expect_params("llama4-moe-init", "transformers", moe.__init__, ["self", "config"])
    expect(re.search(r"self\.experts\(\s*routed_in", source_of("llama4-moe-init", "transformers", moe.forward))
           is not None, "llama4-moe-init", "transformers", "Llama4TextMoe.forward",
           "no longer hands the router-scaled tokens [E*T, H] to self.experts, the layout LinearizedExperts takes")  # fmt: skip
    from llmtune.train.model.linearize import LinearizedExperts, linear_experts

    config = tiny_llama4_config()
    original = moe.__init__
    with linear_experts(config):
        built = moe(config)
    expect(isinstance(built.experts, LinearizedExperts) and moe.__init__ is original, "llama4-moe-init",
           "transformers", "Llama4TextMoe.__init__", "replaced for a load no longer gives LinearizedExperts (or isn't "
           "restored)")  # fmt: skip


# --- transformers, accelerate, peft: which optional libraries a rank may hide ---------------------------------------


def test_optimizer_library_tables():
    module = imported("optimizer-library-tables", "transformers", "transformers.trainer_optimizer")
    from llmtune.train.runtime import libraries

    for name, ours in (("_BITSANDBYTES_OPTIMIZERS", libraries.BITSANDBYTES_OPTIMIZERS),
                       ("_TORCHAO_OPTIMIZERS", libraries.TORCHAO_OPTIMIZERS)):  # fmt: skip
        theirs = getattr(module, name, None)
        values = {getattr(o, "value", o) for o in theirs} if theirs is not None else None
        expect(values == ours, "optimizer-library-tables", "transformers", f"trainer_optimizer.{name}",
               f"is {sorted(values) if values is not None else 'gone'}, llmtune's copy is {sorted(ours)}")  # fmt: skip


def test_hide_unused_libraries():
    from llmtune.train.runtime.libraries import OPTIONAL

    checks = {
        "transformers.utils": ["is_torchao_available", "is_bitsandbytes_available", "is_liger_kernel_available",
                               "is_datasets_available"],
        "transformers.integrations": ["is_deepspeed_available", "is_mlflow_available", "is_wandb_available",
                                      "is_tensorboard_available"],
        "accelerate.utils": ["is_deepspeed_available", "is_bnb_available", "is_torchao_available",
                             "is_datasets_available", "is_mlflow_available", "is_wandb_available",
                             "is_tensorboard_available"],
        "peft.import_utils": ["is_bnb_available", "is_torchao_available"],
    }  # fmt: skip
    code = (f"import sys, importlib\nfor n in {OPTIONAL!r}: sys.modules[n] = None\n"
            f"for m, fs in {checks!r}.items():\n    mod = importlib.import_module(m)\n"
            "    for f in fs: print(f'{m}.{f}', bool(getattr(mod, f)()) if hasattr(mod, f) else 'gone')\n"
            # DeepSpeed's import (its autotuner's `import mlflow`) takes the hidden tracker as not installed
            "del sys.modules['deepspeed']\nimport deepspeed\nprint('deepspeed imported mlflow', 'mlflow' in dir(deepspeed."
            "autotuning.autotuner))\n")  # fmt: skip
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    answers = dict(line.rsplit(" ", 1) for line in shown.stdout.splitlines() if not line.startswith("["))  # DeepSpeed's log
    wrong = {k: v for k, v in answers.items() if v != "False"}
    expect(len(answers) == 18 and not wrong, "hide-unused-libraries", "transformers/accelerate/peft",
           "is_*_available", f"no longer answers False for a library set to None in sys.modules: {wrong}")  # fmt: skip


# --- torch: context parallel on CPU (rehearsal only) ----------------------------------------------------------------


def test_cp_op_handlers():
    from torch.distributed.tensor import DTensor

    dispatcher = getattr(DTensor, "_op_dispatcher", None)
    handlers = getattr(dispatcher, "_custom_op_handlers", None)
    expect(isinstance(handlers, dict), "cp-op-handlers", "torch", "DTensor._op_dispatcher._custom_op_handlers",
           "is no longer a dict of op -> handler")  # fmt: skip
    for method in ("unwrap_to_op_info", "wrap"):
        expect(callable(getattr(dispatcher, method, None)), "cp-op-handlers", "torch",
               f"DTensor._op_dispatcher.{method}", "is gone")  # fmt: skip
    expect(callable(getattr(getattr(dispatcher, "sharding_propagator", None), "propagate", None)), "cp-op-handlers",
           "torch", "DTensor._op_dispatcher.sharding_propagator.propagate", "is gone")  # fmt: skip
    ring = imported("cp-op-handlers", "torch", "torch.distributed.tensor.experimental._context_parallel._attention")
    # torch's own CP swaps the handler dict in and out; llmtune's entries survive only because they go into the
    # dict torch captured at import (see the doc)
    expect(getattr(ring, "existing_custom_ops", None) is handlers, "cp-op-handlers", "torch",
           "_context_parallel._attention.existing_custom_ops",
           "is no longer the dispatcher's own handler dict, so torch's context_parallel() may drop llmtune's handlers")  # fmt: skip


def test_cp_ring_attention():
    ring = imported("cp-ring-attention", "torch", "torch.distributed.tensor.experimental._context_parallel._attention")
    forward = getattr(ring, "_templated_ring_attention", None)
    backward = getattr(ring, "_templated_ring_attention_backward", None)
    expect(forward is not None and backward is not None, "cp-ring-attention", "torch",
           "_context_parallel._attention._templated_ring_attention(_backward)", "is gone")  # fmt: skip
    expect_params("cp-ring-attention", "torch", forward, ["group", "seq_dim", "op", "query", "key", "value",
                                                          "is_causal", "kwargs"])  # fmt: skip
    expect_params("cp-ring-attention", "torch", backward, ["group", "seq_dim", "op", "grad_out", "grad_out_name",
                                                           "query", "key", "value", "out", "logsumexp", "is_causal",
                                                           "kwargs"])  # fmt: skip


def test_cp_cpu_flash_op():
    import torch

    for name, arguments, returns in (
        ("_scaled_dot_product_flash_attention_for_cpu",
         ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"], 2),
        ("_scaled_dot_product_flash_attention_for_cpu_backward",
         ["grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"], 3),
    ):  # fmt: skip
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        expect(op is not None, "cp-cpu-flash-op", "torch", f"aten.{name}", "is gone")
        schema = op._schema
        found = [a.name for a in schema.arguments]
        expect(found == arguments and len(schema.returns) == returns, "cp-cpu-flash-op", "torch", f"aten.{name}",
               f"now takes {found} and returns {len(schema.returns)} values; llmtune passes {arguments} by position "
               f"and takes {returns}")  # fmt: skip


CP_PROBE = """
import os, sys, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from llmtune.train.rehearsal import context_parallel_on_cpu
context_parallel_on_cpu()
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    reference.sum().backward()
    shards = [distribute_tensor(t.detach(), mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*shards, is_causal=True)
    out.sum().backward()
print(out.placements == (Shard(2),), torch.allclose(out.full_tensor(), reference, atol=1e-6),
      all(torch.allclose(s.grad.full_tensor(), t.grad, atol=1e-6) for s, t in zip(shards, (q, k, v))))
dist.destroy_process_group()
"""


def test_context_parallel_on_cpu_runs_ring_attention_end_to_end(tmp_path):
    """All three cp-* entries at once, and the public register_sharding that replaced torch's private strategy
    registration: one CPU rank, q/k/v sharded along the sequence, forward and backward as without DTensors."""
    shown = subprocess.run([sys.executable, "-c", CP_PROBE, str(tmp_path / "store")], capture_output=True, text=True,
                           timeout=300, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    expect(shown.returncode == 0 and shown.stdout.split() == ["True"] * 3, "cp-op-handlers", "torch",
           "context parallel on CPU (DTensor dispatcher, ring attention, aten CPU flash op, register_sharding)",
           f"no longer computes sharded SDPA as the unsharded one: {shown.stdout.strip()} {shown.stderr[-1500:]}")  # fmt: skip


# --- torchao: QAT ---------------------------------------------------------------------------------------------------


def test_qat_mx_autograd():
    import torch

    mx = imported("qat-mx-autograd", "torchao", "torchao.prototype.qat.mx")
    function = getattr(mx, "_MXQuantizedForwardFakeQuantizedBackward", None)
    expect(function is not None and hasattr(function, "apply"), "qat-mx-autograd", "torchao",
           "torchao.prototype.qat.mx._MXQuantizedForwardFakeQuantizedBackward", "is gone")  # fmt: skip
    expect_params("qat-mx-autograd", "torchao", function.forward,
                  ["ctx", "_input", "weight", "bias", "activation_config", "weight_config"])  # fmt: skip
    config = mx.MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
    linear = mx.MXFakeQuantizedLinear(32, 8, bias=True, activation_config=config, weight_config=config)
    linear(torch.randn(2, 32)).sum().backward()
    expect(linear.bias.grad is None, "qat-mx-autograd", "torchao", "MXFakeQuantizedLinear",
           "now trains its bias: PausableMXLinear's bias-outside-the-function workaround can go")  # fmt: skip


def test_qat_int4_config():
    config = imported("qat-int4-config", "torchao", "torchao.quantization.qat.fake_quantize_config",
                      "Int4WeightFakeQuantizeConfig")  # fmt: skip
    expect_params("qat-int4-config", "torchao", config, ["group_size", "activation_dtype"])
    exported = importlib.import_module("torchao.quantization.qat")
    expect(not hasattr(exported, "Int4WeightFakeQuantizeConfig"), "qat-int4-config", "torchao",
           "torchao.quantization.qat.Int4WeightFakeQuantizeConfig",
           "is now exported: import it from there (llmtune/train/model/qat.py) and move this row to 'Replaced'")  # fmt: skip


def test_qat_nvfp4_prototype():
    import torch

    module = "torchao.prototype.mx_formats.nvfp4_tensor"
    tensor = imported("qat-nvfp4-prototype", "torchao", module, "NVFP4Tensor")
    to_scale = imported("qat-nvfp4-prototype", "torchao", module, "per_tensor_amax_to_scale")
    expect_params("qat-nvfp4-prototype", "torchao", tensor.to_nvfp4, ["data_hp", "block_size", "per_tensor_scale"])
    expect_params("qat-nvfp4-prototype", "torchao", tensor.dequantize, ["self", "output_dtype"])
    expect_params("qat-nvfp4-prototype", "torchao", to_scale, ["amax"])
    from llmtune.train.model.qat import nvfp4_round_trip

    x = torch.randn(4, 32)
    rounded = nvfp4_round_trip(x)
    expect(rounded.shape == x.shape and 0 < (rounded - x).abs().max() < x.abs().max(), "qat-nvfp4-prototype",
           "torchao", "NVFP4Tensor.to_nvfp4 / dequantize", "no longer round-trips a tensor to NVFP4 values")  # fmt: skip


def test_qat_class_swap():
    import torch
    from torch import nn

    from llmtune.recipe.qat import Qat
    from llmtune.train.model.qat import EmulatedNVFP4Linear, prepare

    linear = nn.Linear(32, 8)
    names = set(linear.state_dict())
    swapped = EmulatedNVFP4Linear.from_linear(linear, quantize_inputs=False)
    expect(type(swapped) is EmulatedNVFP4Linear and set(swapped.state_dict()) == names, "qat-class-swap", "torch",
           "nn.Linear.__class__", "can no longer be swapped in place for a subclass with the same parameters")  # fmt: skip
    model = nn.Sequential(nn.Linear(32, 32))
    report = prepare(model, Qat.model_validate({"weight_dtype": "mxfp4", "activation_dtype": "mxfp4"}))
    swapped = model[0]
    expect(report["modules"] == {"PausableMXLinear": 1} and hasattr(swapped, "activation_config")
           and hasattr(swapped, "weight_config"), "qat-class-swap", "torchao", "MXFakeQuantizedLinear",
           f"is no longer what quantize_ makes for MX QAT (by that name, with activation_config and weight_config): "
           f"{report['modules']}")  # fmt: skip
    swapped(torch.randn(2, 32)).sum().backward()
    expect(swapped.bias.grad is not None, "qat-class-swap", "torchao", "PausableMXLinear",
           "leaves the bias without a gradient")  # fmt: skip


# --- accelerate: the CPU rehearsal's process state ------------------------------------------------------------------


def test_accelerate_state_relabel():
    import dataclasses

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from transformers.trainer_pt_utils import AcceleratorConfig

    expect("use_configured_state" in {f.name for f in dataclasses.fields(AcceleratorConfig)},
           "accelerate-state-relabel", "transformers", "TrainingArguments.accelerator_config.use_configured_state",
           "is gone: the Trainer would build its own process state instead of the rehearsal's gloo one")  # fmt: skip
    source = source_of("accelerate-state-relabel", "accelerate", AcceleratorState.__init__)
    # the branch that keeps the Trainer's FSDP plugin: its list of process-state types, then its body
    branch = re.search(r"elif self\.distributed_type in \[([^\]]*)\]:(.*?)\n            if ", source, re.DOTALL)
    ok = branch is not None and "DistributedType.MULTI_GPU" in branch.group(1) and "MULTI_CPU" not in branch.group(1)
    expect(ok and "self.fsdp_plugin = fsdp_plugin" in branch.group(2), "accelerate-state-relabel", "accelerate",
           "AcceleratorState.__init__", "no longer keeps the FSDP plugin for a MULTI_GPU process state only (not "
           "MULTI_CPU): the CPU rehearsal's relabelled state may run DDP instead of FSDP, or the relabel is unneeded")  # fmt: skip
    expect(hasattr(DistributedType, "MULTI_GPU") and "_shared_state" in vars(PartialState),
           "accelerate-state-relabel", "accelerate", "PartialState._shared_state / DistributedType.MULTI_GPU",
           "is gone: llmtune writes distributed_type and device into the shared process state")  # fmt: skip


# --- DeepSpeed: ZeRO internals read for the memory check and the rank report ----------------------------------------


def deepspeed_file(relative: str) -> str:
    """A DeepSpeed source file's text, without importing DeepSpeed (slow, and it prints)."""
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None, "deepspeed is a dependency of llmtune and must be installed"
    return (Path(spec.submodule_search_locations[0]) / relative).read_text()


def test_torch_lr_scheduler_last_lr():
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    scheduler = LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), lambda step: 0.5)
    scheduler._last_lr = [0.25]
    expect(scheduler.get_last_lr() == [0.25], "torch-lr-scheduler-last-lr", "torch", "LRScheduler.get_last_lr",
           "no longer returns _last_lr")  # fmt: skip


def test_accelerate_offload_optimizer():
    from accelerate import Accelerator
    from accelerate.utils import deepspeed as accelerate_deepspeed

    source = inspect.getsource(Accelerator._prepare_deepspeed)
    for token in ("map_pytorch_optim_to_deepspeed(optimizer)", "zero_force_ds_cpu_optimizer", "offload_optimizer"):
        expect(token in source, "accelerate-offload-optimizer", "accelerate", "Accelerator._prepare_deepspeed",
               f"no longer holds {token!r}")  # fmt: skip
    mapping = inspect.getsource(accelerate_deepspeed.map_pytorch_optim_to_deepspeed)
    for token in ("optimizer.param_groups", 'defaults["adamw_mode"] = True', "DeepSpeedCPUAdam"):
        expect(token in mapping, "accelerate-offload-optimizer", "accelerate", "map_pytorch_optim_to_deepspeed",
               f"no longer holds {token!r}")  # fmt: skip


def test_deepspeed_zero_internals():
    wanted = {
        "runtime/zero/stage3.py": ["class DeepSpeedZeroOptimizer_Stage3", "self.grad_partitions_flat_buffer",
                                   "self.offload_optimizer =", "self.offload_param ="],
        "runtime/zero/stage_1_and_2.py": ["class DeepSpeedZeroOptimizer(", "self.grads_in_partition",
                                          "self.averaged_gradients", "self.partition_gradients =",
                                          "self.cpu_offload ="],
        "runtime/engine.py": ["class DeepSpeedEngine(", "self.basic_optimizer", "def zero_offload_optimizer(",
                              "def zero_offload_param("],
    }  # fmt: skip
    for relative, tokens in wanted.items():
        text = deepspeed_file(relative)
        for token in tokens:
            expect(token in text, "deepspeed-zero-internals", "deepspeed", f"{relative}: {token}",
                   "is gone (renamed or moved)")  # fmt: skip


def test_trainer_load_rng_state(trainer_calls):
    from transformers import Trainer

    expect_params("trainer-load-rng-state", "transformers", Trainer._load_rng_state, ["self", "checkpoint"])
    loaded = [Path(c) for name, c in trainer_calls["resume"] if name == "_load_rng_state"]
    expect(bool(loaded) and all(c == trainer_calls["out"] / "checkpoint-1" for c in loaded), "trainer-load-rng-state",
           "transformers", "Trainer._load_rng_state",
           f"is no longer called with the checkpoint on resume (calls: {loaded})")  # fmt: skip
    source = source_of("trainer-load-rng-state", "transformers", Trainer._load_rng_state)
    expect("rng_state_" in source and "process_index" in source, "trainer-load-rng-state", "transformers",
           "Trainer._load_rng_state", "no longer reads one rng_state_<rank> file per process")  # fmt: skip


def test_deepspeed_zero3_universal_load():
    from deepspeed.checkpoint import ds_to_universal

    parser = source_of("deepspeed-zero3-universal-load", "deepspeed", ds_to_universal.parse_arguments)
    for name in ("input_folder", "output_folder", "num_extract_workers", "num_merge_workers", "keep_temp_folder",
                 "no_strict", "inject_missing_state"):  # fmt: skip
        expect(f"--{name}" in parser, "deepspeed-zero3-universal-load", "deepspeed", "ds_to_universal.parse_arguments",
               f"no longer has --{name} (llmtune passes its namespace to main())")  # fmt: skip
    text = deepspeed_file("runtime/zero/stage3.py")
    loader = text[text.index("def load_hp_checkpoint_state_from_checkpoint_dir_stage3") :][:4000]
    expect("= state_step" in loader and '["param_groups"][0]' in loader, "deepspeed-zero3-universal-load",
           "deepspeed", "stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3",
           "no longer shares one step tensor or copies group 0's hyperparameters: the repair may be dropped")  # fmt: skip
    expect("self.optimizer.state[fp32_param]" in loader, "deepspeed-zero3-universal-load", "deepspeed",
           "DeepSpeedZeroOptimizer_Stage3.optimizer", "no longer holds the torch optimizer the state is loaded into")  # fmt: skip
    expect("optim_sd[OPTIMIZER_STATE_DICT]['state'][0]['step']" in loader, "deepspeed-zero3-universal-load",
           "deepspeed", "stage3 universal loader", "no longer reads the step where fit_layout writes it")  # fmt: skip
    base = deepspeed_file("runtime/base_optimizer.py")
    expect("optim_sd['param_groups']" in base, "deepspeed-zero3-universal-load", "deepspeed",
           "base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir", "no longer reads the top-level param_groups")  # fmt: skip
    engine = deepspeed_file("runtime/engine.py")
    names = engine[engine.index("def _get_ckpt_name(") :][:1200]
    expect('"zero_pp_rank_{}"' in names and '"mp_rank_" + mp_rank_str + "_model_states.pt"' in names,
           "deepspeed-zero3-universal-load", "deepspeed", "DeepSpeedEngine._get_ckpt_name",
           "names the model-states files otherwise (fit_layout writes the new stage's)")  # fmt: skip
    from transformers import Trainer

    decay = inspect.getsource(Trainer.get_decay_parameter_names)
    expect("self." not in decay.split(":", 1)[1], "deepspeed-zero3-universal-load", "transformers",
           "Trainer.get_decay_parameter_names", "now reads instance state (from_replicated calls it unbound)")  # fmt: skip
    loading = engine[engine.index("def _load_checkpoint(") :][:9000]
    expect("self.lr_scheduler.load_state_dict(checkpoint['lr_scheduler'])" in loading
           and "if not self.load_universal_checkpoint():\n            self.load_module_state_dict" in loading,
           "deepspeed-zero3-universal-load", "deepspeed", "DeepSpeedEngine._load_checkpoint",
           "no longer loads the schedule from the model states, or reads the module in a universal load")  # fmt: skip


def test_deepspeed_compatible_ops():
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    expect(ShareMemCommBuilder.NAME == "deepspeed_shm_comm", "deepspeed-compatible-ops", "deepspeed",
           "ShareMemCommBuilder.NAME", f"is now {ShareMemCommBuilder.NAME!r}")  # fmt: skip
    builder = deepspeed_file("comm/torch.py")
    builder = builder[builder.index("def build_shm_op"):][:600]
    expect("__compatible_ops__.get(builder.NAME" in builder and "return None" in builder, "deepspeed-compatible-ops",
           "deepspeed", "deepspeed.comm.torch.build_shm_op", "no longer skips an op its probe marks unavailable")  # fmt: skip
    expect("build_shm_op()" in deepspeed_file("comm/torch.py").split("class TorchBackend", 1)[1],
           "deepspeed-compatible-ops", "deepspeed", "TorchBackend.__init__", "builds the op some other way")  # fmt: skip
    ops = deepspeed_file("ops/__init__.py")
    expect('globals()["__compatible_ops__"]' in ops, "deepspeed-compatible-ops", "deepspeed",
           "deepspeed.ops.__compatible_ops__", "is no longer one cached module dict (an edit may not persist)")  # fmt: skip


def test_deepspeed_cpu_info_once():
    for path, where in (("ops/adam/cpu_adam.py", "DeepSpeedCPUAdam.__init__"),
                        ("ops/op_builder/builder.py", "OpBuilder.cpu_arch and simd_width")):  # fmt: skip
        text = deepspeed_file(path)
        expect(text.count("from cpuinfo import get_cpu_info") >= (1 if "adam" in path else 2)
               and not re.search(r"^(from cpuinfo|import cpuinfo)", text, re.M), "deepspeed-cpu-info-once",
               "deepspeed", where, "no longer imports py-cpuinfo's function at call time")  # fmt: skip


def test_deepspeed_param_attributes():
    text = deepspeed_file("runtime/zero/partition_parameters.py")
    for attribute in ("ds_tensor", "ds_id", "ds_shape"):
        expect(re.search(rf"\.{attribute} =", text) is not None, "deepspeed-param-attributes", "deepspeed",
               f"a ZeRO-3 parameter's .{attribute}", "is no longer set by zero.Init")  # fmt: skip


def test_deepspeed_ulysses_adapter():
    text = deepspeed_file("runtime/sequence_parallel/ulysses_sp.py")
    adapter = text[text.index("class UlyssesSPDataLoaderAdapter"):]
    for needle, what in (("self.dl = dl", "keeps the loader it wraps as .dl"),
                         ("self.iter = iter(dl)", "opens its iterator as .iter when it is built"),
                         ("self.iter = iter(self.dl)", "reopens .iter on .dl at the end of an epoch")):  # fmt: skip
        expect(needle in adapter, "deepspeed-ulysses-adapter", "deepspeed", "UlyssesSPDataLoaderAdapter",
               f"no longer {what}")  # fmt: skip


# --- liger-kernel, flash attention kwargs, tensor subclasses ---------------------------------------------------------


def test_liger_model_table():
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed here (GPU runs used 0.8.5)")
    table = imported("liger-model-table", "liger-kernel", "liger_kernel.transformers.monkey_patch",
                     "MODEL_TYPE_TO_APPLY_LIGER_FN")  # fmt: skip
    apply = table.get("llama") if isinstance(table, dict) else None
    expect(apply is not None, "liger-model-table", "liger-kernel", "MODEL_TYPE_TO_APPLY_LIGER_FN['llama']", "is gone")
    parameters = inspect.signature(apply).parameters
    flags = [n for n, p in parameters.items() if isinstance(p.default, bool)]
    expect("model" in parameters and {"rms_norm", "fused_linear_cross_entropy"} <= set(flags), "liger-model-table",
           "liger-kernel", "apply_liger_kernel_to_llama", f"no longer takes model= and boolean kernel flags: {flags}")  # fmt: skip


def test_flash_varlen_kwargs():
    kwargs = imported("flash-varlen-kwargs", "transformers", "transformers.modeling_flash_attention_utils",
                      "FlashAttentionKwargs")  # fmt: skip
    names = ["cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"]
    expect(set(names) <= set(getattr(kwargs, "__annotations__", {})), "flash-varlen-kwargs", "transformers",
           "FlashAttentionKwargs", f"no longer declares {names}")  # fmt: skip
    forward = imported("flash-varlen-kwargs", "transformers", "transformers.modeling_flash_attention_utils",
                       "_flash_attention_forward")  # fmt: skip
    expect_params("flash-varlen-kwargs", "transformers", forward, names)
    from transformers import LlamaModel

    expect(any(p.kind is p.VAR_KEYWORD for p in inspect.signature(LlamaModel.forward).parameters.values()),
           "flash-varlen-kwargs", "transformers", "LlamaModel.forward",
           "no longer passes **kwargs on to attention: the packed rows' boundaries would not reach flash attention")  # fmt: skip


def test_varlen_attention_no_mask():
    """A flat batch through a tiny Llama: the registered function gets the collator's boundaries and no mask."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtune.train.data.collate import REAL_TOKENS, ROW_LENGTHS, FlatCollator
    from llmtune.train.model import varlen

    seen = []
    real = varlen.varlen_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")))
        return real(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    AttentionInterface.register("llmtune_varlen", spy)
    try:
        model.set_attn_implementation("llmtune_varlen")
        batch = FlatCollator(0)([{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}, {"input_ids": [6, 7], "labels": [6, 7]}])
        batch.pop(REAL_TOKENS), batch.pop(ROW_LENGTHS)
        with torch.no_grad():
            model(**batch)
    finally:
        varlen.register()
    expect(bool(seen), "varlen-attention-no-mask", "transformers", "AttentionInterface.register",
           "no longer routes the model's attention to a registered function")  # fmt: skip
    mask, bounds, longest = seen[0]
    expect(mask is None, "varlen-attention-no-mask", "transformers", "masking_utils.create_causal_mask",
           "now builds a mask for an attention implementation with no mask function (padding-free steps pay for it)")  # fmt: skip
    expect(bounds is not None and bounds.tolist() == [0, 3, 5] and longest == 3, "varlen-attention-no-mask",
           "transformers", "LlamaModel.forward(**kwargs)", "no longer passes the batch's cu_seq_lens_q/max_length_q "
           "down to attention: padding-free rows would attend to each other")  # fmt: skip


def test_no_split_modules_present():
    """transformers' models list their layer classes in _no_split_modules, and accelerate's wrap policy reads the
    model instance's attribute (so the cut of keep_present_layer_classes reaches it)."""
    import inspect as inspect_module

    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    expect("LlamaDecoderLayer" in (model._no_split_modules or ()), "no-split-modules-present", "transformers",
           "PreTrainedModel._no_split_modules", "no longer lists the decoder layer class")  # fmt: skip
    source = inspect_module.getsource(FullyShardedDataParallelPlugin.set_auto_wrap_policy)
    expect('getattr(model, "_no_split_modules"' in source, "no-split-modules-present", "accelerate",
           "FullyShardedDataParallelPlugin.set_auto_wrap_policy", "no longer reads the model's _no_split_modules")  # fmt: skip


def test_no_split_modules_layers():
    """The decoder layer classes are in _no_split_modules and hand **kwargs to their attention call (the source
    llmtune reads), for the families that take padding-free batches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtune.train.model.varlen import _passes_boundaries

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    layer = type(model.model.layers[0])
    expect(layer.__name__ in model._no_split_modules, "no-split-modules-layers", "transformers",
           "PreTrainedModel._no_split_modules", "no longer names the decoder layer class")  # fmt: skip
    expect(_passes_boundaries(layer), "no-split-modules-layers", "transformers", "LlamaDecoderLayer.forward",
           "no longer shows a self_attn(..., **kwargs) call llmtune can read")  # fmt: skip


def test_modelling_source_text():
    """transformers' files, read as text by the plan, still say what its classes say."""
    from transformers import FalconForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM

    from llmtune.plan.padding_free import _layers, modelling_source

    for model_type, model_class in (("llama", LlamaForCausalLM), ("gemma3_text", Gemma3ForCausalLM),
                                    ("falcon", FalconForCausalLM)):  # fmt: skip
        source = modelling_source(model_type)
        expect(source is not None, "modelling-source-text", "transformers", f"models/.../modeling_*.py of {model_type}",
               "is no longer where SPECIAL_MODEL_TYPE_TO_MODULE_NAME or the model type puts it")  # fmt: skip
        expect(("_supports_attention_backend = True" in source) == model_class.is_backend_compatible(),
               "modelling-source-text", "transformers", f"{model_class.__name__}._supports_attention_backend",
               "is no longer set by a `_supports_attention_backend = True` line in its modelling file")  # fmt: skip
        expect(set(model_class._no_split_modules) <= set(_layers(source)) | {None}, "modelling-source-text",
               "transformers", f"{model_class.__name__}._no_split_modules", "is no longer a literal list in its file")  # fmt: skip


def test_conversion_table_text():
    """transformers' conversion table, read as text by the estimate, is the one it imports; peft maps the layouts
    llmtune mirrors."""
    from llmtune.plan.memory.experts import PEFT_MAPPED_LAYOUTS, conversion_layouts

    table = imported("conversion-table-text", "transformers", "transformers.conversion_mapping",
                     "_MODEL_TO_CONVERSION_PATTERN")  # fmt: skip
    expect(conversion_layouts() == table, "conversion-table-text", "transformers",
           "conversion_mapping._MODEL_TO_CONVERSION_PATTERN", "is no longer a literal dict assigned in the file")
    peft_table = imported("conversion-table-text", "peft", "peft.utils.transformers_weight_conversion",
                          "_MOE_TARGET_MODULE_MAPPING")  # fmt: skip
    expect(set(peft_table) == set(PEFT_MAPPED_LAYOUTS), "conversion-table-text", "peft",
           "transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING", f"now maps {sorted(peft_table)}")

def test_tensor_flatten():
    import torch
    from torch import nn

    optim = imported("tensor-flatten", "torchao", "torchao.optim", "AdamW8bit")
    from llmtune.train.runtime.memory import model_state_bytes

    model = nn.Linear(256, 256, bias=False)
    optimizer = optim(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    expect(all(hasattr(type(v), "__tensor_flatten__") for v in states), "tensor-flatten", "torchao",
           "AdamW8bit's state tensors' __tensor_flatten__", "is gone: llmtune counts their bytes through it")  # fmt: skip
    counted, n = model_state_bytes(model, optimizer)["optimizer"], 256 * 256
    expect(2 * n <= counted < 2.2 * n, "tensor-flatten", "torchao", "__tensor_flatten__ of OptimState8bit",
           f"no longer yields the 8-bit codes and scales: counted {counted} bytes for two 8-bit states of {n}")  # fmt: skip


# --- TRL ----------------------------------------------------------------------------------------------------------


def test_trl_experimental_trainers():
    import dataclasses

    from llmtune.train.rl.trainers import trl_classes

    for rl, fields in (("orpo", {"beta", "max_length"}), ("simpo", {"beta", "loss_type", "simpo_gamma", "cpo_alpha"})):
        try:
            config, trainer = trl_classes(rl)
        except ImportError as err:
            expect(False, "trl-experimental-trainers", "trl", f"the rl: {rl} trainer", f"can't be imported ({err})")
        names = {f.name for f in dataclasses.fields(config)}
        expect(fields <= names, "trl-experimental-trainers", "trl", config.__name__, f"lacks {fields - names}")
        expect_params("trl-experimental-trainers", "trl", trainer.__init__, ["model", "args", "train_dataset",
                      "eval_dataset", "processing_class", "callbacks"])  # fmt: skip
    config, _ = trl_classes("simpo")
    expect(config(output_dir="x", loss_type="simpo", use_cpu=True).loss_type == "simpo", "trl-experimental-trainers",
           "trl", "CPOConfig.loss_type", "no longer takes 'simpo'")  # fmt: skip


@pytest.fixture(scope="module")
def tiny_peft(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from tiny import load_tokenizer, make_tiny_model
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("trl") / "m", layers=1, hidden=32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path)),
                           LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))  # fmt: skip
    return model, load_tokenizer()


def test_trl_reference_adapter(tiny_peft, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tokenizer = tiny_peft
    rows = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2)
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_length=16)
    trainer = DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    expect("ref" in trainer.model.peft_config, "trl-reference-adapter", "trl", "DPOTrainer",
           "no longer copies a PeftModel's adapter as 'ref': llmtune's deletion of it is moot (check the new name)")  # fmt: skip
    expect(trainer.ref_model is None, "trl-reference-adapter", "trl", "DPOTrainer.ref_model",
           "is set for a PeftModel: the reference is held separately")  # fmt: skip
    source = inspect.getsource(DPOTrainer)
    expect('"ref" in' in source and "disable_adapter" in source or "use_adapter" in source, "trl-reference-adapter",
           "trl", "DPOTrainer's reference pass", "no longer falls back to the adapters-off model without 'ref'")  # fmt: skip
    trainer.model.delete_adapter("ref")  # what llmtune does for a fresh adapter


def test_trl_batch_layout(tiny_peft, tmp_path):
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    pair = {"prompt_ids": [1, 2], "chosen_ids": [3, 4, 5], "rejected_ids": [6]}
    batch = DataCollatorForPreference(pad_token_id=0)([pair, pair])
    expect(tuple(batch["input_ids"].shape[:1]) == (4,) and "attention_mask" in batch, "trl-batch-layout", "trl",
           "DataCollatorForPreference", f"no longer stacks chosen and rejected rows: {sorted(batch)}")  # fmt: skip
    expect(torch.equal(batch["input_ids"][0, :5], torch.tensor([1, 2, 3, 4, 5])), "trl-batch-layout", "trl",
           "DataCollatorForPreference", "no longer puts the chosen rows first")  # fmt: skip
    single = {"prompt_ids": [1], "completion_ids": [2, 3], "label": True}
    unpaired = DataCollatorForUnpairedPreference(pad_token_id=0)([single, single])
    expect(tuple(unpaired["input_ids"].shape[:1]) == (2,), "trl-batch-layout", "trl",
           "DataCollatorForUnpairedPreference", f"gives {sorted(unpaired)}")  # fmt: skip
    from datasets import Dataset

    from llmtune.train.rl.trainers import trl_classes

    model, tokenizer = tiny_peft
    config, trainer_class = trl_classes("orpo")
    rows = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2)
    args = config(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_length=16, per_device_train_batch_size=2,
                  remove_unused_columns=False)  # fmt: skip
    trainer = trainer_class(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    keys = set(next(iter(trainer.get_train_dataloader())))
    needed = {"chosen_input_ids", "chosen_attention_mask", "rejected_attention_mask"}
    expect(needed <= keys, "trl-batch-layout", "trl", "ORPO's batch", f"lacks {needed - keys} (has {sorted(keys)})")


def test_trl_kto_sequential_sampler():
    from trl import KTOTrainer

    expect("train_sampling_strategy='sequential'" in inspect.getsource(KTOTrainer.__init__),
           "trl-kto-sequential-sampler", "trl", "KTOTrainer.__init__",
           "no longer requires the sequential sampler: llmtune may drop train_sampling_strategy='sequential'")  # fmt: skip


# --- replaced by public APIs: the replacements do the job ----------------------------------------------------------


def test_sharded_fsdp_checkpoint_loads_through_public_dcp(tmp_path):
    """post/consolidate.load_dcp_model, which replaced DCP's private _load_state_dict_from_keys."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from llmtune.post.consolidate import RunWeights, consolidate

    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(3, 4), "lm_head.weight": torch.randn(5, 2).bfloat16()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": dict(state)}, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"), no_dist=True)
    loaded = consolidate(RunWeights("fsdp", tmp_path, ""))
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())
