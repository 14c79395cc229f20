"""Axolotl's vocabulary across its releases (llmtune/recipe/axolotl_history.py, generated from Axolotl's tags by
scripts/axolotl_key_history.py): no key any release defined is ever "unknown key", the table says what llmtune
does with each, and a message about an old key names the releases that defined it and today's spelling."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from recipe_loading import load, refusal

from llmtune.errors import UserError
from llmtune.recipe.axolotl import action, history
from llmtune.recipe.axolotl_history import DATASET_KEYS, DEPRECATED, ERAS, KEYS, RELEASES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import axolotl_key_history as generator  # noqa: E402

LATEST = RELEASES[-1]
ACTIONS = ("llmtune", "alias of ", "translated", "no effect", "refused: ")


def defined(release: str) -> list[str]:
    """The top-level keys this release defined: within each key's first..last span, less its gaps."""
    index = RELEASES.index(release)
    return [
        key
        for key, (first, last, _, *gaps) in KEYS.items()
        if RELEASES.index(first) <= index <= RELEASES.index(last) and release not in (gaps[0] if gaps else ())
    ]


def test_the_table_covers_every_release_from_v0_3_0():
    versions = [tuple(int(p) for p in tag[1:].split(".")) for tag in RELEASES]
    assert RELEASES[0] == "v0.3.0" and versions == sorted(versions) and len(RELEASES) >= 28
    assert {"v0.4.0", "v0.5.0", "v0.6.0", "v0.8.0", "v0.12.0"} <= set(RELEASES)
    assert ERAS["v0.3.0"] == ERAS["v0.4.0"] == "README" and ERAS["v0.5.0"] == ERAS[LATEST] == "schema"
    for release in RELEASES:
        keys = defined(release)
        assert len(keys) > 100 and {"base_model", "datasets", "sequence_len", "micro_batch_size"} <= set(keys)
    # keys the history must hold: ones today's Axolotl no longer defines, and the era each came from
    assert KEYS["relora_steps"][:2] == ("v0.3.0", "v0.11.0") and KEYS["eval_table_max_new_tokens"][1] == "v0.4.0"
    assert KEYS["max_packed_sequence_len"][0] == "v0.3.0" and DEPRECATED["max_packed_sequence_len"] == "v0.5.0"


@pytest.mark.parametrize("release", RELEASES)
def test_no_key_a_release_defined_is_unknown(release):
    keys = defined(release)
    assert not [key for key in keys if action(key) == "unknown"]
    for key in keys:
        if key not in ("base_model", "datasets"):
            load(**{key: None})  # a key written without a value is the recipe without it, never an error


@pytest.mark.parametrize("key", sorted(set(KEYS) - {"base_model", "datasets"}))
def test_a_value_for_any_release_key_is_read_or_refused_by_name(key):
    kind = action(key)
    try:
        loaded = load(**{key: "asked-for"})
    except UserError as err:
        line = err.one_line()
        assert "unknown key" not in line and key in line and "\n" not in line
        assert kind != "no effect"  # those take any value
    else:
        assert not kind.startswith("refused")  # a value that asks for a missing capability is an error
        if kind == "no effect":
            assert sum(key in note and "no effect" in note for note in loaded.notes) == 1


def test_the_table_says_what_llmtune_does_today():
    """The generated actions match llmtune's tables (re-run scripts/axolotl_key_history.py when they change)."""
    stale = {key: (row[2], action(key)) for key, row in KEYS.items() if row[2] != action(key)}
    stale |= {key: (row[2], action(key, "dataset")) for key, row in DATASET_KEYS.items()
              if row[2] != action(key, "dataset")}  # fmt: skip
    assert not stale, "run: python scripts/axolotl_key_history.py --refresh"
    assert all(row[2].startswith(ACTIONS) for row in KEYS.values())


def test_no_key_is_both_llmtune_s_and_in_the_axolotl_tables():
    """A key the schema honours shadows its entry in axolotl_keys.py, which would then say the wrong thing."""
    from llmtune.recipe.axolotl_keys import AXOLOTL_ONLY_KEYS, INTENDED, RENAMED, TRANSLATED
    from llmtune.recipe.schema import Recipe

    assert not set(Recipe.model_fields) & {*AXOLOTL_ONLY_KEYS, *RENAMED, *INTENDED, *TRANSLATED}


def test_a_refusal_of_a_dropped_key_names_its_releases():
    dropped = [key for key, row in KEYS.items() if row[1] != LATEST and row[2].startswith("refused")]
    assert len(dropped) >= 10
    for key in dropped:
        first, last = KEYS[key][:2]
        releases = f"{first} only" if first == last else f"{first} to {last}"
        assert f"; {key} is a key of Axolotl {releases}" in refusal(**{key: "asked-for"})


def test_messages_about_old_keys_name_today_s_spelling():
    line = refusal(log_sweep_min_lr=1e-6)
    assert line.startswith("r.yaml: the log-sweep learning-rate schedule is not supported (log_sweep_min_lr: 1e-06); "
                           "log_sweep_min_lr is a key of Axolotl v0.3.0 to v0.4.0, dropped after v0.4.0")  # fmt: skip
    notes = load(relora_steps=100, relora_warmup_steps=5, adapter="lora").notes
    assert "relora_warmup_steps: read as jagged_restart_warmup_steps (a key of Axolotl v0.3.0 to v0.11.0; today's " \
           "spelling: jagged_restart_warmup_steps)" in notes  # fmt: skip
    assert "today's spelling: load_in_4bit with adapter: qlora" in refusal(load_4bit=True)
    notes = load(eval_table_max_new_tokens=128, noisy_embedding_alpha=5).notes
    assert any("eval_table_max_new_tokens (a key of Axolotl v0.4.0 only; today's spelling: eval_max_new_tokens)"
               in n and "no effect" in n for n in notes)  # fmt: skip
    assert "noisy_embedding_alpha: read as neftune_noise_alpha (a key of Axolotl since v0.4.0, deprecated since " \
           "v0.5.0; today's spelling: neftune_noise_alpha)" in notes  # fmt: skip
    assert history("sequence_len") == "" and history("not_a_key") == ""


def test_the_generator_reads_fields_aliases_and_base_classes():
    classes = generator.Classes()
    classes.read(
        "class Dataset(BaseModel):\n    path: str\n    field_human: str | None = None\n"
        "class Base(BaseModel):\n    lora_r: int = 8\n    _private: int = 0\n"
        "class Remapped(BaseModel):\n    type_of_model: str | None = Field(default=None, alias='model_type')\n"
        "class AxolotlInputConfig(Base, Remapped):\n    model_config = ConfigDict()\n"
        "    datasets: list[Dataset] | None = None\n"
    )
    top = classes.keys("AxolotlInputConfig")
    assert set(top) == {"lora_r", "type_of_model", "model_type", "datasets"}
    assert classes.nested(top["datasets"]) == {"path", "field_human"}
    tags = ["v0.3.0", "v0.4.0", "v0.5.0"]
    spans = generator.spans(tags, {"v0.3.0": {"a", "b"}, "v0.4.0": {"a"}, "v0.5.0": {"a", "b"}})
    assert spans == {"a": ("v0.3.0", "v0.5.0", ()), "b": ("v0.3.0", "v0.5.0", ("v0.4.0",))}
    assert generator.version("v0.5.1.post1") is None and generator.version("v0.10.0") == (0, 10, 0)
