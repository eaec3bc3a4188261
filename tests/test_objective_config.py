"""Objectives own their config: `config.objective` is `name` + the chosen objective's fields, an
unknown field is refused with the list of the valid ones, and an objective may live outside the
package (`path/to/file.py:Class`, `module:Class`)."""

import json
import os
import sys
import textwrap

import pytest

from tests.conftest import ROOT, tiny_config
from tfx import config as config_lib
from tfx.config import ConfigError, load_config, validate
from tfx.objectives import Objective, placeholder_ids
from tfx.registry import OBJECTIVES, load_builtins

TINY = os.path.join(ROOT, "configs", "tiny.py")

MY_OBJECTIVE = textwrap.dedent('''
    """A test objective outside the package: causal LM with a label-smoothing knob."""
    import dataclasses

    from tfx import ops
    from tfx.objectives import Objective, Predictions, causal_visible, flat_positions
    from tfx.objectives.causal_lm import causal_lm_inputs


    @dataclasses.dataclass(frozen=True)
    class MyObjective(Objective):
      """Next-token prediction, written outside tfx."""

      # How much weight the padding-free targets get (a knob to test the config path).
      weight: float = 1.0
      label: str = "x"  # a trailing comment documents a field too

      families = ("decoder",)
      uses_rng = False  # no masks drawn from the key (tfx.check_objective would flag a key that changes nothing)

      def forward(self, model, params, batch, rng, *, train):
        x = causal_lm_inputs(batch, self.ids.bos if self.ids.bos is not None else self.ids.eos)
        logits = model.apply({"params": params}, x["inputs"], batch["segment_ids"], batch["positions"],
                             train=train, rngs={"dropout": rng})
        return logits, x

      def loss(self, model, params, batch, rng, *, train):
        logits, x = self.forward(model, params, batch, rng, train=train)
        return ops.weighted_cross_entropy(logits, x["targets"], x["weights"] * self.weight, z_loss=self.z_loss)

      def predictions(self, model, params, batch, rng):
        logits, x = self.forward(model, params, batch, rng, train=False)
        return Predictions(logits, x["targets"], x["weights"], flat_positions(batch["segment_ids"]),
                           visible=causal_visible(batch["segment_ids"]))


    class NotAnObjective:
      pass
''')


@pytest.fixture
def objective_file(tmp_path):
  path = tmp_path / "my_objective.py"
  path.write_text(MY_OBJECTIVE)
  return str(path)


def test_unknown_field_is_refused_with_the_valid_ones():
  with pytest.raises(ConfigError, match=r"objective 'causal_lm' has no field 'noise_density'; its fields are: z_loss"):
    tiny_config("--config.objective.noise_density=0.5")
  with pytest.raises(ConfigError, match=r"objective 'masked_lm' has no field 'mask_rat'.*mask_rate \(float, default "
                                        r"0.15\)"):
    tiny_config("--config.objective.name=masked_lm", "--config.objective.mask_rat=0.2")


def test_switching_objective_on_the_command_line_takes_its_fields_and_defaults():
  c = tiny_config("--config.objective.mask_rate=0.2", "--config.objective.name=masked_lm")  # order does not matter
  assert c.objective.to_dict() == {"name": "masked_lm", "z_loss": 0.0, "mask_rate": 0.2, "mask_token_rate": 0.8,
                                   "random_token_rate": 0.1, "whole_word": False, "max_predictions": 0,
                                   "gather_predictions": True}
  assert isinstance(c.objective.mask_rate, float)
  # A config file's settings of its own objective's fields go away with it when the name changes.
  t5 = load_config(os.path.join(ROOT, "configs", "t5_tiny.py"), ["--config.objective.name=causal_lm",
                                                                   "--config.model.family=decoder"])
  assert t5.objective.to_dict() == {"name": "causal_lm", "z_loss": 0.0}


def test_a_config_file_with_a_foreign_field_is_refused(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(textwrap.dedent(f'''
      import sys
      sys.path.insert(0, {ROOT!r})
      from configs import tiny

      def get_config():
        c = tiny.get_config()
        c.objective.noise_density = 0.5  # a span corruption field under causal_lm
        return c
  '''))
  with pytest.raises(ConfigError, match="objective 'causal_lm' has no field 'noise_density'"):
    load_config(str(path))


def test_programmatic_configs_are_checked_by_validate():
  c = tiny_config()
  with c.unlocked():
    c.objective.mask_rate = 0.3
  with pytest.raises(ConfigError, match="has no field 'mask_rate'"):
    validate(c, num_devices=1)


def test_old_flat_config_json_still_loads():
  """A config.json written when config.objective held every objective's fields."""
  c = tiny_config("--config.objective.name=masked_lm", "--config.model.family=encoder")
  flat = json.loads(config_lib.to_json(c))
  flat["objective"].update(noise_density=0.15, mean_span_length=3.0, num_predict=0, row_layout="xlnet")
  back = config_lib.from_json(json.dumps(flat))
  assert sorted(back.objective.keys()) == sorted(c.objective.keys())


def test_every_shipped_objective_documents_its_fields():
  load_builtins()
  for name, cls in OBJECTIVES.items():
    for option in cls.options():
      assert option.doc, f"{name}.{option.name} has no comment"
    obj = cls.from_config({"name": name}, placeholder_ids(1000))
    assert isinstance(obj, Objective)


def test_list_objectives_prints_every_objective_with_families_and_fields(capsys):
  from tfx import train

  train.main(["--list-objectives"])
  out = capsys.readouterr().out
  for name, cls in OBJECTIVES.items():
    assert f"{name}  [{', '.join(cls.families)}]" in out
    for option in cls.options():
      assert f"{option.name}: {option.type.__name__} = {option.default!r}  # {option.doc}" in out


def test_objective_from_a_file_outside_the_package(objective_file):
  spec = f"{objective_file}:MyObjective"
  c = tiny_config(f"--config.objective.name={spec}", "--config.objective.weight=0.5")
  assert c.objective.to_dict() == {"name": spec, "z_loss": 0.0, "weight": 0.5, "label": "x"}
  validate(c, num_devices=1)
  cls = OBJECTIVES.get(spec)
  assert cls is OBJECTIVES.get(spec)  # loaded once
  docs = {o.name: o.doc for o in cls.options()}
  assert docs == {"z_loss": docs["z_loss"], "weight": "How much weight the padding-free targets get (a knob to test "
                  "the config path).", "label": "a trailing comment documents a field too"}
  with pytest.raises(ConfigError, match="objective '.*MyObjective' has no field 'mask_rate'; its fields are: z_loss "
                                        r"\(float, default 0.0\), weight \(float, default 1.0\), label"):
    tiny_config(f"--config.objective.name={spec}", "--config.objective.mask_rate=0.1")


def test_objective_from_a_module_outside_the_package(objective_file, monkeypatch):
  monkeypatch.syspath_prepend(os.path.dirname(objective_file))
  c = tiny_config("--config.objective.name=my_objective:MyObjective")
  validate(c, num_devices=1)
  assert OBJECTIVES.get("my_objective:MyObjective").__name__ == "MyObjective"
  sys.modules.pop("my_objective", None)


@pytest.mark.parametrize("suffix, message", [
    (":NotAnObjective", "is not a subclass of tfx.objectives.base.Objective"),
    (":Nope", "has no 'Nope'; its classes: .*MyObjective"),
    ("x:MyObjective", "does not exist"),
])
def test_bad_outside_objectives_say_what_is_wrong(objective_file, suffix, message):
  spec = objective_file + suffix if not suffix.startswith("x") else objective_file + "x" + suffix[1:]
  with pytest.raises(ConfigError, match=message):
    tiny_config(f"--config.objective.name={spec}")


def test_an_objective_file_that_fails_to_import_names_itself(tmp_path):
  bad = tmp_path / "broken.py"
  bad.write_text("import no_such_module_anywhere\n")
  with pytest.raises(ConfigError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
    tiny_config(f"--config.objective.name={bad}:Whatever")
  with pytest.raises(ConfigError, match=r"cannot import module 'no_such_pkg.mod'"):
    tiny_config("--config.objective.name=no_such_pkg.mod:Whatever")
