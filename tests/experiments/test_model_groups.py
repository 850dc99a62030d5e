"""The Hydra model group (experiments/conf/model) against megaslide.models.dit.DIT_PRESETS, its one source.

A group file names a preset (`preset:`) and includes `_fields`, which lists every DiTConfig field as null
(null keeps the preset's value), so that any field is overridable on the command line without `+`. A file
named after a preset is that preset unchanged; any other file is a derived model: a preset plus overrides."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from megaslide.config import DiTConfig
from megaslide.models.dit import DIT_PRESETS

GROUP = Path(__file__).parents[2] / "experiments" / "conf" / "model"
FIELDS = [f.name for f in dataclasses.fields(DiTConfig) if f.name != "attention"]
GROUP_FILES = sorted(p for p in GROUP.glob("*.yaml") if p.name != "_fields.yaml")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_fields_lists_every_model_field_as_null():
    # the keys that moved to the execution group stay listed, so that model.<key> gets the error naming the move
    assert _load(GROUP / "_fields.yaml") == dict.fromkeys([*FIELDS, *DiTConfig.moved_keys])


def test_every_preset_has_its_group_file():
    assert [name for name in DIT_PRESETS if not (GROUP / f"{name}.yaml").is_file()] == []


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: p.stem)
def test_a_group_file_agrees_with_dit_presets(path):
    group = _load(path)
    assert group.pop("defaults") == ["_fields", "_self_"], "include _fields first, so every field is overridable"
    preset = group.pop("preset", None)
    assert preset in DIT_PRESETS, f"{path.name}: preset {preset!r} is not in DIT_PRESETS {sorted(DIT_PRESETS)}"
    unknown = sorted(set(group) - set(FIELDS))
    assert unknown == [], f"{path.name}: {unknown} are not DiTConfig fields"
    if path.stem in DIT_PRESETS:
        assert (preset, group) == (path.stem, {}), f"{path.name} must be preset {path.stem} unchanged"
    else:
        assert group, f"{path.name} changes nothing: use model={preset}"
        dataclasses.replace(DIT_PRESETS[preset], **group).validate()
