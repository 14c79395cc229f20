"""Functions a recipe names from the user's own files, as Axolotl writes them: `module.function`, where the module
is a .py file in the recipe's folder, else in the working directory (where Axolotl's examples put it: it runs
`python -m` there), else anywhere on the Python path. GRPO's reward functions
(`trl.reward_funcs: [rwd.correctness_reward]`) and dataset transforms (`datasets[].type: rwd.gsm8k_transform`).

Resolving one imports the module: the recipe's own code runs, as it does under Axolotl. A name that doesn't resolve
is refused when the recipe is read, naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from llmtune.errors import UserError


def looks_like_function(name: str) -> bool:
    """`module.function` (dotted, no path separator): not a model path or a hub id."""
    return isinstance(name, str) and "." in name and "/" not in name and not name.endswith((".py", ".json"))


def resolve(name: str, folder: Path | None, key: str):
    """The callable `name` names: <folder>/<module>.py first, then <working directory>/<module>.py, then the Python
    path. UserError naming `key`."""
    module_name, _, function = name.rpartition(".")
    module = None
    relative = Path(*module_name.split(".")).with_suffix(".py")
    places = list(dict.fromkeys(Path(place).resolve() / relative for place in (folder, Path.cwd()) if place))
    candidate = next((place for place in places if place.is_file()), None)
    try:
        if candidate is not None:
            module = sys.modules.get(f"llmtune_user.{module_name}")
            if module is None or getattr(module, "__file__", None) != str(candidate):  # (another folder's same name)
                spec = importlib.util.spec_from_file_location(f"llmtune_user.{module_name}", candidate)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            where = f"not {', '.join(map(str, places))}, nor" if places else "not"
            raise UserError(f"{key}: {name}: no module {module_name} ({where} on the Python path)",
                            f"put {module_name.split('.')[-1]}.py beside the recipe or in the working "
                            "directory") from None  # fmt: skip
        raise UserError(
            f"{key}: {name}: importing {module_name} failed: {err}", "fix the import in that file"
        ) from None
    except SyntaxError as err:
        raise UserError(f"{key}: {name}: {module_name} has a syntax error at line {err.lineno}: {err.msg}",
                        "fix the file") from None  # fmt: skip
    except Exception as err:  # the user's module raised while being imported
        raise UserError(f"{key}: {name}: importing {module_name} raised {type(err).__name__}: {err}",
                        "fix the file") from None  # fmt: skip
    found = getattr(module, function, None)
    if not callable(found):
        defined = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise UserError(f"{key}: {name}: {module_name} has no function {function}",
                        f"it defines {', '.join(defined) or 'no function'}")  # fmt: skip
    return found
