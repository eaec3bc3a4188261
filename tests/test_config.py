"""Configs: strict overrides and validation messages that say how to fix the problem."""

import json
import os

import pytest

from tests.conftest import ROOT, tiny_config
from tfx import config as config_lib
from tfx.config import ConfigError, load_config, validate
from tfx.registry import FAMILIES, Registry

BASE = os.path.join(ROOT, "configs", "base.py")


def test_contract_keys_exist():
  c = load_config(BASE)
  for key in ["model.family", "model.num_layers", "model.d_model", "model.num_heads", "model.d_ff", "model.position",
              "model.norm", "model.dropout", "model.dtype", "model.scan_layers", "model.remat", "objective.name",
              "data.source", "data.seq_len", "data.vocab_size", "data.tokenizer", "train.steps", "train.batch_size",
              "train.seed", "train.log_every", "train.eval_every", "train.checkpoint_every", "optim.learning_rate",
              "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip", "mesh.data", "mesh.fsdp", "mesh.tensor"]:
    section, name = key.split(".")
    assert name in c[section], key


def test_overrides_are_typed():
  c = load_config(BASE, ["--config.train.steps=7", "--config.optim.learning_rate=1", "--config.model.scan_layers=false",
                         "--config.data.source", "text:*.txt"])
  assert c.train.steps == 7 and isinstance(c.train.steps, int)
  assert c.optim.learning_rate == 1.0 and isinstance(c.optim.learning_rate, float)
  assert c.model.scan_layers is False
  assert c.data.source == "text:*.txt"


@pytest.mark.parametrize("arg, message", [
    ("--config.train.stepz=3", "unknown config key 'train.stepz'"),
    ("--config.nosuch.x=3", "unknown config key 'nosuch.x'"),
    ("--config.train.steps=1.5", "expected an int"),
    ("--config.train.steps=many", "expected an int"),
    ("--config.model.scan_layers=maybe", "expected a bool"),
    ("--config.optim.learning_rate=fast", "expected a float"),
    ("--config.model=3", "is a section"),
    ("--steps=3", "config overrides look like"),
])
def test_bad_overrides(arg, message):
  with pytest.raises(ConfigError, match=message):
    load_config(BASE, [arg])


def test_missing_config_file():
  with pytest.raises(ConfigError, match="does not exist"):
    load_config("configs/no_such_config.py")


def test_valid_configs_pass():
  for name in ("base.py", "tiny.py", "quickstart.py", "bert_base.py", "roberta_base.py", "t5_base.py", "bert_tiny.py",
               "roberta_tiny.py", "t5_tiny.py", "xlnet_base.py", "xlnet_tiny.py"):
    validate(load_config(os.path.join(ROOT, "configs", name)), num_devices=1)
  validate(tiny_config("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"), num_devices=8)
  validate(tiny_config("--config.model.num_heads=6", "--config.model.head_dim=16"), num_devices=1)  # 6 x 16 on 64


XLNET = ["--config.model.family=xlnet", "--config.objective.name=permutation_lm"]


@pytest.mark.parametrize("overrides, devices, message", [
    (["--config.model.num_heads=3"], 1, "num_heads=3 does not divide model.d_model=64"),
    (["--config.model.num_heads=3", "--config.model.head_dim=5", "--config.model.position=rotary"], 1,
     "rotary positions need an even head dim; got 5"),
    (["--config.mesh.data=4"], 8, r"needs 4 devices but there are 8"),
    (["--config.mesh.data=3", "--config.mesh.fsdp=-1"], 8, "does not fit 8 devices"),
    (["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], 8, "at most one of"),
    (["--config.train.batch_size=6"], 4, "does not split across the data axes"),
    (["--config.train.batch_size=8", "--config.train.grad_accum=4"], 4, "micro-batch 2"),
    (["--config.mesh.data=2", "--config.mesh.tensor=4", "--config.model.num_heads=2", "--config.model.d_model=64"],
     8, "mesh.tensor=4 does not divide model.num_heads=2"),
    (["--config.model.position=alibi"], 1, "model.position='alibi'"),
    (["--config.model.norm=sandwich"], 1, "model.norm='sandwich'"),
    (["--config.model.remat=everything"], 1, "model.remat='everything'"),
    (["--config.model.family=nope"], 1, "model.family='nope' is not registered"),
    (["--config.objective.name=nope"], 1, "objective.name='nope' is not registered"),
    (["--config.data.seq_len=1"], 1, "data.seq_len=1"),
    (["--config.train.steps=0"], 1, "train.steps=0"),
    (["--config.data.verify_store=sometimes"], 1, "data.verify_store='sometimes'"),
    (["--config.data.prefetch=-1"], 1, "data.prefetch=-1 must be >= 0"),
    (["--config.model.packed_runs=-2"], 1, "model.packed_runs=-2 must be >= 0"),
    (["--config.model.causal_blocks=-1"], 1, "model.causal_blocks=-1 must be >= 0"),
    (XLNET + ["--config.model.packed_runs=8"], 1, "the xlnet family's masks do not take it"),
    (["--config.data.shard_mb=0"], 1, "data.shard_mb=0.0 must be positive"),
    (["--config.data.source=prepared:"], 1, "needs a store directory"),
    (XLNET + ["--config.objective.row_layout=bert"], 1, "row_layout must be one of"),
    (XLNET + ["--config.objective.reuse_len=60", "--config.objective.perm_size=4"], 1, "seq_len - reuse_len >= 5"),
    (XLNET + ["--config.objective.perm_size=24"], 1, "perm_size=24 must divide both halves"),
    (XLNET + ["--config.objective.bi_data=true", "--config.train.batch_size=3"], 1, "even train.batch_size"),
    (XLNET + ["--config.objective.bi_data=true", "--config.train.batch_size=6", "--config.train.grad_accum=2"], 1,
     "make train.batch_size / train.grad_accum even"),
    (XLNET + ["--config.model.mem_len=16", "--config.model.reuse_len=16"], 1, "model.reuse_len=16 must equal"),
    (["--config.objective.name=masked_lm", "--config.model.family=encoder", "--config.objective.mask_rate=1.5"], 1,
     r"mask_rate must be in \[0, 1\]"),
    (["--config.objective.name=permutation_lm", "--config.model.family=encoder", "--config.model.mem_len=8"], 1,
     "has no memory"),
    (["--config.objective.name=nsp", "--config.model.family=encoder", "--config.model.type_vocab_size=2",
      "--config.train.batch_size=1"], 1, "a \\(micro-\\)batch of 1 row has no other row"),
])
def test_validate_messages(overrides, devices, message):
  with pytest.raises(ConfigError, match=message):
    validate(tiny_config(*overrides), num_devices=devices)


def test_every_host_needs_batch_shards_of_its_own():
  # 2 hosts x 2 devices with mesh.tensor=4: both hosts would hold the one batch shard and feed it different rows.
  with pytest.raises(ConfigError, match="mesh.data \\* mesh.fsdp = 1 is not a multiple of the 2 hosts"):
    validate(tiny_config("--config.mesh.data=1", "--config.mesh.tensor=4", "--config.model.num_heads=4",
                         "--config.model.d_ff=128"), num_devices=4, process_count=2)
  validate(tiny_config("--config.mesh.data=2", "--config.mesh.tensor=2"), num_devices=4, process_count=2)


def test_objective_that_cannot_drive_the_family():
  from tfx.models.decoder import Decoder

  name = "family_only_for_this_test"
  if name not in FAMILIES:
    FAMILIES.register(name)(Decoder)
  with pytest.raises(ConfigError, match="objective 'causal_lm' cannot drive model family 'family_only_for_this_test'"):
    validate(tiny_config(f"--config.model.family={name}"), num_devices=1)


def test_registry_errors():
  r = Registry("widget")
  r.register("a")(object)
  with pytest.raises(ValueError, match="registered twice"):
    r.register("a")(object)
  with pytest.raises(ValueError, match="known: a"):
    r.get("b")


def test_json_round_trip():
  c = tiny_config()
  back = config_lib.from_json(config_lib.to_json(c))
  assert json.loads(config_lib.to_json(back)) == json.loads(config_lib.to_json(c))
