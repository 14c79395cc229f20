"""How many of Axolotl's example recipes llmtune accepts: `python scripts/axolotl_examples.py DIR`.

DIR is a checkout's examples/ folder (or any folder of Axolotl recipes). Each YAML under it is validated and
planned as `llmtune validate --device cuda --num-processes N` would (offline: hub models and datasets are
named, not downloaded). Prints the first refusal of every recipe not accepted, then the counts: over all
recipes, and over the text ones (neither a vision/audio recipe, `processor_type`, nor `rl:` training).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the llmtune of this checkout, not an installed one

import yaml  # noqa: E402

from llmtune.errors import UserError  # noqa: E402
from llmtune.plan import make_cluster, make_plan  # noqa: E402
from llmtune.recipe import load_recipe  # noqa: E402


def kind(path: Path) -> str:
    """'vision', 'rl' or 'text', from the raw YAML (a recipe that doesn't parse counts as text)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        return "text"
    if not isinstance(raw, dict):
        return "text"
    if raw.get("processor_type"):
        return "vision"
    return "rl" if raw.get("rl") else "text"


def check(path: Path, processes: int, device: str, check_files: bool = True) -> str | None:
    """None when accepted, else the one-line refusal. check_files=False leaves local paths unchecked (a recipe
    from elsewhere names its author's own data files; scripts/axolotl_corpus.py looks past them)."""
    try:
        loaded = load_recipe(path, check_files=check_files)
        recipe = loaded.recipe
        if recipe.lisa_n_layers:
            processes = 1  # LISA runs in one process (at more, llmtune says so)
        processes = max(processes, recipe.least_mesh_ranks)  # a recipe that lays out its mesh is planned at that size
        make_plan(loaded.recipe, make_cluster(processes, device=device), config_dir=str(path.parent / ".llmtune"))
    except UserError as err:
        return err.one_line().replace(f"{path}: ", "").replace(str(path), "<recipe>")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="Axolotl's examples/ folder")
    parser.add_argument("--num-processes", type=int, default=2, help="processes to plan for (default 2)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the rehearsal's plan)")
    args = parser.parse_args(argv)
    recipes = sorted(p for p in args.folder.rglob("*") if p.suffix in (".yml", ".yaml") and p.is_file())
    if not recipes:
        print(f"no .yml/.yaml files under {args.folder}", file=sys.stderr)
        return 2
    totals, accepted = Counter(), Counter()
    for path in recipes:
        group = kind(path)
        totals[group] += 1
        refusal = check(path, args.num_processes, args.device)
        if refusal is None:
            accepted[group] += 1
        else:
            print(f"{path.relative_to(args.folder)} [{group}]: {refusal}")
    text, everything = accepted["text"], sum(accepted.values())
    print(f"\naccepted {everything}/{len(recipes)} ({everything / len(recipes):.0%}) of all recipes; "
          f"text: {text}/{totals['text']} ({text / max(1, totals['text']):.0%}); "
          f"vision: {accepted['vision']}/{totals['vision']}, rl: {accepted['rl']}/{totals['rl']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
