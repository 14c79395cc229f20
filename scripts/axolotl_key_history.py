"""Axolotl's config keys at every release, from its own git history:
`python scripts/axolotl_key_history.py GIT_DIR [--write llmtune/recipe/axolotl_history.py]`.

GIT_DIR is a clone (bare or not) of github.com/axolotl-ai-cloud/axolotl with its tags. For every release tag from
v0.3.0 on, the keys that release defined are read from the tag's own files, in one of two ways:

- schema era (v0.5.0 on): the pydantic schema. AxolotlInputConfig and every base class it names, found across
  src/axolotl/utils/config/models/input/ (v0.5-v0.7) or src/axolotl/utils/schemas/ (v0.8 on): each annotated
  field, under its name and under its `alias=` (the YAML spelling where they differ). Plus the fields of every
  integration's args class (src/axolotl/integrations/<name>/: the class its plugin's get_input_args returns), which
  Axolotl merges into the schema when the plugin is listed. Dataset-entry keys: the fields of the classes the
  `datasets`, `test_datasets` and `pretraining_dataset` annotations name (and the classes those name).
- README era (v0.3.0, v0.4.0): no schema; a key was whatever the code read. The keys are the top-level keys of
  README.md's "All yaml options" YAML block, together with every `cfg.<key>`, `cfg["<key>"]` and `cfg.get("<key>")`
  read anywhere under src/axolotl/ (Axolotl's DictDefault returns None for a key never set, so each such read is a
  key a recipe could set). Dataset-entry keys: the keys under `datasets:` in that YAML block, and every
  `<d>.<key>` read on a dataset entry in src/axolotl/utils/data.py (d, config_dataset, ds_cfg).

`python scripts/axolotl_key_history.py --refresh` re-writes only the actions, from the table's own releases (run it
after changing llmtune's key tables; no Axolotl clone needed).

Prints one line per release (its key counts) and, with --write, writes the declared table the recipe loader reads:
each key with the first and last release that defined it, the releases in between that did not, and what llmtune
does with it today (from llmtune's own tables, so re-run this after changing them; a unit test checks they agree).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

FIRST = (0, 3, 0)
NOT_KEYS = {"get", "keys", "items", "values", "update", "setdefault", "pop", "copy", "to_dict", "model_dump"}
README_BLOCK = re.compile(r"All yaml options.*?```yaml\n(.*?)```", re.S)
CFG_READ = re.compile(r"\bcfg\.([a-z_][a-z0-9_]*)\b|\bcfg\[\s*[\"']([a-z_][a-z0-9_]*)[\"']\s*\]"
                      r"|\bcfg\.get\(\s*[\"']([a-z_][a-z0-9_]*)[\"']")  # fmt: skip
DATASET_READ = re.compile(r"\b(?:d|config_dataset|ds_cfg)\.([a-z][a-z0-9_]*)\b(?!\s*\()")  # reads, not calls
INPUT_ARGS = re.compile(
    r"def get_input_args\((?:(?!\n    def ).)*?return\s+[\"'](axolotl\.integrations\.[\w.]+)[\"']", re.S
)


def git(gitdir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=True, capture_output=True, text=True).stdout


def version(tag: str) -> tuple[int, ...] | None:
    match = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", tag)  # release tags only (no .post1 re-tags)
    return tuple(int(part) for part in match.groups()) if match else None


def releases(gitdir: Path) -> list[str]:
    tags = [tag for tag in git(gitdir, "tag").split() if version(tag) and version(tag) >= FIRST]
    return sorted(tags, key=version)


# --- schema era ---------------------------------------------------------------------------------------------------


class Classes:
    """Every class in a set of Python files: its base names, its fields (names and aliases), the names its fields'
    annotations mention."""

    def __init__(self) -> None:
        self.bases: dict[str, list[str]] = {}
        self.fields: dict[str, dict[str, set[str]]] = {}  # class -> field -> names its annotation mentions

    def read(self, source: str) -> None:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                self.bases[node.name] = [ast.unparse(base).split(".")[-1] for base in node.bases]
                self.fields[node.name] = fields = {}
                for item in node.body:
                    if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                        continue
                    name = item.target.id
                    if name.startswith("_") or name == "model_config":
                        continue
                    mentions = {n.id for n in ast.walk(item.annotation) if isinstance(n, ast.Name)}
                    mentions |= {n.attr for n in ast.walk(item.annotation) if isinstance(n, ast.Attribute)}
                    fields[name] = mentions
                    for alias in _aliases(item.value):
                        fields[alias] = mentions

    def keys(self, root: str) -> dict[str, set[str]]:
        """Fields of root and of every base it names (transitively), with their annotations' mentions."""
        found: dict[str, set[str]] = {}
        todo, seen = [root], set()
        while todo:
            name = todo.pop()
            if name in seen or name not in self.fields:
                continue
            seen.add(name)
            found.update(self.fields[name])
            todo += self.bases[name]
        return found

    def nested(self, mentions: set[str]) -> set[str]:
        """Field names of the classes named in mentions, and of the classes their fields name in turn."""
        keys: set[str] = set()
        todo, seen = list(mentions), set()
        while todo:
            name = todo.pop()
            if name in seen or name not in self.fields:
                continue
            seen.add(name)
            for key, inner in self.keys(name).items():
                keys.add(key)
                todo += inner
        return keys


def _aliases(value: ast.expr | None) -> list[str]:
    if not (isinstance(value, ast.Call) and ast.unparse(value.func).endswith("Field")):
        return []
    return [kw.value.value for kw in value.keywords
            if kw.arg in ("alias", "validation_alias") and isinstance(kw.value, ast.Constant)
            and isinstance(kw.value.value, str)]  # fmt: skip


def schema_keys(gitdir: Path, tag: str, files: list[str]) -> tuple[set[str], set[str], set[str]]:
    classes = Classes()
    roots = ("src/axolotl/utils/schemas/", "src/axolotl/utils/config/models/input/")
    for path in files:
        if path.endswith(".py") and path.startswith(roots):
            classes.read(git(gitdir, "show", f"{tag}:{path}"))
    top = classes.keys("AxolotlInputConfig")
    datasets = classes.nested(set().union(*(top.get(k, set()) for k in ("datasets", "test_datasets",
                                                                          "pretraining_dataset"))))  # fmt: skip
    keys = set(top)
    for name, args_file in integration_args(gitdir, tag, files):
        plugin = Classes()
        plugin.read(git(gitdir, "show", f"{tag}:{args_file}"))
        keys |= set(plugin.keys(name))
    return keys, datasets, set(classes.keys("DeprecatedParameters"))


def integration_args(gitdir: Path, tag: str, files: list[str]) -> list[tuple[str, str]]:
    """(args class, the file defining it) of every integration plugin at this tag."""
    found = []
    for path in files:
        parts = path.split("/")
        if len(parts) != 5 or parts[:3] != ["src", "axolotl", "integrations"] or not path.endswith(".py"):
            continue
        text = git(gitdir, "show", f"{tag}:{path}")
        for target in INPUT_ARGS.findall(text):
            module, name = target.rsplit(".", 1)
            module_path = "src/" + module.replace(".", "/")
            for candidate in (module_path + ".py", module_path + "/args.py", module_path + "/__init__.py"):
                if candidate in files and f"class {name}" in git(gitdir, "show", f"{tag}:{candidate}"):
                    found.append((name, candidate))
                    break
    return found


# --- README era ---------------------------------------------------------------------------------------------------


def readme_keys(gitdir: Path, tag: str, files: list[str]) -> tuple[set[str], set[str], set[str]]:
    block = README_BLOCK.search(git(gitdir, "show", f"{tag}:README.md"))
    if not block:
        raise SystemExit(f"{tag}: README.md has no 'All yaml options' block")
    keys, datasets, under = set(), set(), None
    for line in block.group(1).splitlines():
        match = re.match(r"^(\s*)(?:-\s+)?([a-z_][a-z0-9_]*):", line)
        if not match:
            continue
        indent, key = match.groups()
        if not indent:
            keys.add(key)
            under = key
        elif under == "datasets":
            datasets.add(key)
    for path in files:
        if path.startswith("src/axolotl/") and path.endswith(".py"):
            text = git(gitdir, "show", f"{tag}:{path}")
            keys |= {next(filter(None, groups)) for groups in CFG_READ.findall(text)} - NOT_KEYS
            if path == "src/axolotl/utils/data.py":
                datasets |= set(DATASET_READ.findall(text)) - NOT_KEYS
    return keys, datasets, set()


def release_keys(gitdir: Path, tag: str) -> tuple[str, set[str], set[str], set[str]]:
    """(era, top-level keys, dataset-entry keys, keys the schema lists as deprecated)."""
    files = git(gitdir, "ls-tree", "-r", "--name-only", tag).split()
    if any(path.startswith(("src/axolotl/utils/schemas/", "src/axolotl/utils/config/models/")) for path in files):
        return "schema", *schema_keys(gitdir, tag, files)
    return "README", *readme_keys(gitdir, tag, files)


# --- the table ----------------------------------------------------------------------------------------------------


def spans(tags: list[str], defined: dict[str, set[str]]) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """key -> (first release, last release, releases in between that did not define it)."""
    table = {}
    for key in sorted(set().union(*defined.values())):
        present = [tag for tag in tags if key in defined[tag]]
        first, last = tags.index(present[0]), tags.index(present[-1])
        table[key] = (present[0], present[-1], tuple(t for t in tags[first : last + 1] if key not in defined[t]))
    return table


def render(tags: list[str], eras: dict[str, str], top: dict, datasets: dict, deprecated: dict) -> str:
    from llmtune.recipe.axolotl import action  # llmtune's classification, from its live tables

    def row(key, span, kind):
        gaps = f", {span[2]!r}" if span[2] else ""
        return f"    {key!r}: ({span[0]!r}, {span[1]!r}, {action(key, kind)!r}{gaps}),\n"

    out = ['"""Axolotl\'s config keys at each release: generated by scripts/axolotl_key_history.py from Axolotl\'s release\n'
           "tags; do not edit by hand.\n\nKEYS and DATASET_KEYS: key -> (first release that defined it, last release, what "
           "llmtune does with it\ntoday[, releases in between that did not define it]). The actions come from the tables "
           "of llmtune/recipe/\n(axolotl.action); a unit test checks that they agree, so re-run the script (--refresh) after "
           "changing them.\n\"\"\"\n\n",
           "# fmt: off\n", f"RELEASES = {tuple(tags)!r}\n", f"ERAS = {eras!r}\n",
           "# Keys Axolotl's schema lists as deprecated (its DeprecatedParameters), with the first release that did.\n",
           f"DEPRECATED = {deprecated!r}\n\nKEYS = {{\n"]  # fmt: skip
    out += [row(key, span, "top") for key, span in top.items()]
    out.append("}\n\nDATASET_KEYS = {\n")
    out += [row(key, span, "dataset") for key, span in datasets.items()]
    out.append("}\n# fmt: on\n")
    return "".join(out)


def refresh(module: Path) -> None:
    """Re-render the table with llmtune's actions of today, keeping its releases (no Axolotl clone needed)."""
    from llmtune.recipe import axolotl_history as table

    def rows(keys):
        return {key: (row[0], row[1], row[3] if len(row) > 3 else ()) for key, row in keys.items()}

    text = render(list(table.RELEASES), table.ERAS, rows(table.KEYS), rows(table.DATASET_KEYS), table.DEPRECATED)
    module.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gitdir", type=Path, nargs="?", help="an Axolotl clone (not needed with --refresh)")
    parser.add_argument("--write", type=Path, help="write the table module here")
    parser.add_argument("--refresh", action="store_true", help="with --write: only update llmtune's actions")
    args = parser.parse_args()
    if args.refresh:
        refresh(args.write or Path(__file__).resolve().parents[1] / "llmtune" / "recipe" / "axolotl_history.py")
        return
    if args.gitdir is None:
        parser.error("give an Axolotl git dir, or --refresh")
    tags = releases(args.gitdir)
    eras, top, datasets, deprecated = {}, {}, {}, {}
    for tag in tags:
        eras[tag], top[tag], datasets[tag], old = release_keys(args.gitdir, tag)
        for key in sorted(old):
            deprecated.setdefault(key, tag)
        print(f"{tag:9} {eras[tag]:7} {len(top[tag]):4} keys {len(datasets[tag]):4} dataset-entry keys")
    if args.write:
        args.write.write_text(render(tags, eras, spans(tags, top), spans(tags, datasets), deprecated), encoding="utf-8")
        print(f"wrote {args.write}", file=sys.stderr)


if __name__ == "__main__":
    main()
