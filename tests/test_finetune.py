"""Fine-tuning: what each family pools, the row layout, the loop end to end from tiny pretrained runs
(files, metrics splits, exact resume, early stopping keeps the best params, the test split scored
once), the CLI, and the acceptance property (pretrained beats scratch on stdlib:package, over seeds)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.conftest import ROOT, tiny_config
from tfx import finetune, train
from tfx.config import load_config
from tfx.metrics import Progress, read_metrics
from tfx.models import ClassifierHead, build_classifier, build_model
from tfx.steps import make_optimizer

# A fine-tune that runs in seconds: 4 stdlib packages, rows of 32 tokens, 16 steps of 8 examples.
SMOKE = ("finetune.stdlib_classes=4", "finetune.max_train_examples=120", "finetune.max_eval_examples=80",
         "finetune.steps=16", "finetune.eval_every=4", "finetune.log_every=4", "finetune.batch_size=8",
         "finetune.max_length=32", "finetune.learning_rate=1e-3", "finetune.warmup_steps=2", "finetune.patience=0")
TIMING = ("tokens_per_sec", "mfu")

FAMILY_OVERRIDES = {
    "decoder": (),
    "encoder": ("--config.model.family=encoder", "--config.objective.name=masked_lm", "--config.model.type_vocab_size=2",
                "--config.model.norm=post", "--config.model.embed_norm=true"),
    "encoder_decoder": ("--config.model.family=encoder_decoder", "--config.objective.name=span_corruption",
                        "--config.model.position=relative"),
    "xlnet": ("--config.model.family=xlnet", "--config.objective.name=permutation_lm", "--config.model.position=relative",
              "--config.model.norm=post", "--config.model.mem_len=16"),
}


@pytest.fixture(scope="session")
def pretrained_decoder(tmp_path_factory, shared_tokenizer) -> str:
  """configs/tiny.py trained 20 steps on 60 stdlib files."""
  workdir = str(tmp_path_factory.mktemp("pretrained_decoder"))
  train.run(tiny_config(f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=60",
                        "--config.train.steps=20", "--config.train.eval_every=0", "--config.train.checkpoint_every=20"),
            workdir)
  return workdir


@pytest.fixture(scope="session")
def pretrained_encoder(tmp_path_factory, shared_tokenizer) -> str:
  """configs/bert_tiny.py (MLM, token types) trained 20 steps on 60 stdlib files."""
  workdir = str(tmp_path_factory.mktemp("pretrained_encoder"))
  config = load_config(os.path.join(ROOT, "configs", "bert_tiny.py"), [
      f"--config.data.tokenizer={shared_tokenizer}", "--config.data.max_documents=60", "--config.train.steps=20",
      "--config.train.eval_every=0", "--config.train.checkpoint_every=20"])
  train.run(config, workdir)
  return workdir


def without_timing(records):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


# ----------------------------------------------------------------------------- pooling and rows


def right_padded(key, lengths, length, vocab):
  """tokens, segment_ids, positions, token_types [b, length]: random real tokens, then padding."""
  b = len(lengths)
  real = np.arange(length)[None, :] < np.asarray(lengths)[:, None]  # [b, t]
  tokens = np.where(real, np.asarray(jax.random.randint(key, (b, length), 5, vocab)), 0)
  types = np.where(real & (np.arange(length)[None, :] >= 3), 1, 0)
  positions = np.where(real, np.arange(length)[None, :], 0)
  return [jnp.asarray(x, jnp.int32) for x in (tokens, real.astype(np.int32), positions, types)]


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_padding_after_the_last_real_token_changes_nothing(family):
  """Whatever follows a row's last real token (tokens, token types) leaves its logits unchanged;
  a real token does change them; the default pooling is the family's."""
  config = tiny_config(*FAMILY_OVERRIDES[family])
  model = build_classifier(build_model(config.model, vocab_size=300, max_length=16), 3)
  assert model.pooling == {"decoder": "last", "encoder": "first", "encoder_decoder": "mean", "xlnet": "last"}[family]
  tokens, segments, positions, types = right_padded(jax.random.key(0), [5, 9, 16], 16, 300)
  params = model.init({"params": jax.random.key(1)}, tokens, segments, positions, types)["params"]
  logits = model.apply({"params": params}, tokens, segments, positions, types)  # [3, 3]
  pad = segments == 0
  noisy = jnp.where(pad, jax.random.randint(jax.random.key(2), tokens.shape, 5, 300), tokens)
  noisy_types = jnp.where(pad, 1, types)
  np.testing.assert_allclose(model.apply({"params": params}, noisy, segments, positions, noisy_types), logits,
                             atol=1e-6)
  last = jnp.asarray([4, 8, 15])  # the last real token of each row
  changed = tokens.at[jnp.arange(3), last].set(4)
  assert np.all(np.abs(np.asarray(model.apply({"params": params}, changed, segments, positions, types) - logits)
                       ).max(axis=-1) > 1e-6)


@pytest.mark.parametrize("family,overrides", [
    ("decoder", ()),
    ("decoder", ("--config.model.scan_layers=False", "--config.model.num_layers=3", "--config.model.remat=none")),
    ("decoder", ("--config.model.position=rotary", "--config.model.num_layers=1")),
    ("encoder", ()),
    ("encoder", ("--config.model.position=relative",)),  # a bias: the last layer runs in full
    ("xlnet", ()),
    ("xlnet", ("--config.model.scan_layers=False",)),
], ids=["decoder", "decoder_unscanned", "decoder_rotary_one_layer", "encoder", "encoder_relative", "xlnet",
        "xlnet_unscanned"])
def test_the_pooled_row_alone_gives_the_full_stacks_logits_and_gradients(family, overrides):
  """A classifier pooling one position ('first', 'last') runs its backbone's last layer at that
  row alone; the logits and every parameter's gradient are those of the full stack's hidden
  states pooled afterwards (the backbone and the head applied apart), padded rows included."""
  config = tiny_config(*FAMILY_OVERRIDES[family], *overrides)
  model = build_classifier(build_model(config.model, vocab_size=300, max_length=16), 3)
  inputs = right_padded(jax.random.key(0), [5, 9, 16, 1], 16, 300)
  params = model.init({"params": jax.random.key(1)}, *inputs)["params"]
  head = ClassifierHead(3, pooling=model.pooling, init_std=config.model.init_std)

  def full(p):  # the full stack, then the head pools
    hidden = model.backbone.apply({"params": p["backbone"]}, *inputs, method=type(model.backbone).sequence_hidden)
    return head.apply({"params": p["head"]}, hidden, inputs[1])

  def loss(f):
    return lambda p: jnp.sum(jnp.sin(f(p)))  # every logit gets its own cotangent

  pooled = lambda p: model.apply({"params": p}, *inputs)
  np.testing.assert_allclose(jax.jit(pooled)(params), jax.jit(full)(params), rtol=1e-5, atol=1e-6)
  grads = jax.jit(jax.grad(loss(pooled)))(params)
  expected = jax.jit(jax.grad(loss(full)))(params)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree_util.tree_leaves(grads["backbone"]))


def test_decoder_pools_the_last_real_token():
  """Causal attention: with 'last' pooling the logits depend on the first token too (the last
  position sees it), and equal those of the same text without its padding."""
  config = tiny_config()
  model = build_classifier(build_model(config.model, vocab_size=300, max_length=16), 3)
  tokens, segments, positions, types = right_padded(jax.random.key(0), [6], 16, 300)
  params = model.init({"params": jax.random.key(1)}, tokens, segments, positions, types)["params"]
  logits = model.apply({"params": params}, tokens, segments, positions, types)
  short = [x[:, :6] for x in (tokens, segments, positions, types)]
  np.testing.assert_allclose(model.apply({"params": params}, *short), logits, atol=1e-6)
  first_changed = tokens.at[0, 0].set(7 if int(tokens[0, 0]) != 7 else 8)
  assert np.abs(np.asarray(model.apply({"params": params}, first_changed, segments, positions, types) - logits)).max() > 1e-6


def test_classifier_head_pooling_positions():
  """'last' reads the last token with segment > 0, 'first' position 0, 'mean' the mean over segment 1."""
  hidden = jax.random.normal(jax.random.key(0), (3, 7, 8))
  segments = jnp.asarray([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0]])
  head = ClassifierHead(4, pooling="last")
  params = head.init(jax.random.key(1), hidden, segments)
  picked = hidden[jnp.arange(3), jnp.asarray([2, 6, 0])][:, None]  # [3, 1, 8]
  expected = ClassifierHead(4, pooling="first").apply(params, picked, jnp.ones((3, 1), jnp.int32))
  np.testing.assert_allclose(head.apply(params, hidden, segments), expected, atol=1e-6)
  mean = jnp.sum(hidden * segments[..., None], axis=1) / jnp.sum(segments, axis=1)[:, None]
  np.testing.assert_allclose(ClassifierHead(4, pooling="mean").apply(params, hidden, segments),
                             ClassifierHead(4, pooling="first").apply(params, mean[:, None], jnp.ones((3, 1))),
                             atol=1e-5)


# ----------------------------------------------------------------------------- initialisation


def test_backbone_from_the_checkpoint_head_from_the_seed(tmp_path, pretrained_decoder):
  """init=pretrained copies every backbone parameter from the run's checkpoint; the head comes
  from the seed's key alone (the same for pretrained and scratch, another for another seed)."""

  def initial(init, seed):
    setup = finetune.build(None, pretrained_decoder, "stdlib:package", str(tmp_path / f"{init}{seed}"),
                           [*SMOKE, f"finetune.init={init}", f"finetune.seed={seed}"])
    exp = setup.exp
    _, shardings = train.state_shardings(exp.model, exp.tx, exp.mesh, setup.length)
    state, best, book = finetune._initial_state(setup, shardings, finetune._copier(exp, shardings), Progress(1))
    return state.params, book

  pretrained, book = initial("pretrained", 0)
  scratch, _ = initial("scratch", 0)
  other_seed, _ = initial("pretrained", 1)
  assert book["pretrained_step"] == 20
  _, _, _, checkpoint_params = train.load_trained(pretrained_decoder)
  for x, y in zip(leaves(pretrained["backbone"]), leaves(checkpoint_params)):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(leaves(scratch["backbone"]), leaves(checkpoint_params)))
  for x, y in zip(leaves(pretrained["head"]), leaves(scratch["head"])):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(leaves(pretrained["head"]), leaves(other_seed["head"])))


def test_scratch_without_a_run_trains_the_tokenizer_pretraining_would(tmp_path):
  """from_workdir=None: the architecture and data come from the config, and the tokenizer is the
  one `tfx.train` trains for that config, so a scratch baseline sees the same ids."""
  config = tiny_config("--config.data.max_documents=30", "--config.train.steps=1", "--config.train.seed=3")
  train.run(config, str(tmp_path / "pretrain"))
  setup = finetune.build(config, None, "stdlib:package", str(tmp_path / "scratch"), [*SMOKE, "finetune.seed=5"])
  assert setup.config.finetune.init == "scratch" and setup.pretrained_config is None
  assert (tmp_path / "scratch" / "tokenizer.model").read_bytes() == (tmp_path / "pretrain" / "tokenizer.model").read_bytes()


# ----------------------------------------------------------------------------- the loop


def count_test_scoring(monkeypatch, validation_scores=None):
  """Wraps finetune.evaluate_rows: records the params the test split is scored with, and optionally
  replaces the validation accuracies by a script."""
  real = finetune.evaluate_rows
  scored = []
  script = iter(validation_scores or ())

  def wrapped(predict, params, rows, split, *args):
    out = real(predict, params, rows, split, *args)
    if split == "test":
      scored.append(leaves(params))
    elif validation_scores is not None:
      out["accuracy"] = next(script)
    return out

  monkeypatch.setattr(finetune, "evaluate_rows", wrapped)
  return scored


def test_finetune_decoder_end_to_end(tmp_path, pretrained_decoder, monkeypatch):
  scored = count_test_scoring(monkeypatch)
  workdir = str(tmp_path / "ft")
  result = finetune.run(None, pretrained_decoder, "stdlib:package", workdir, overrides=SMOKE)
  for name in ("config.json", "finetune_task.json", "finetune_result.json", "metrics.jsonl", "tokenizer.model"):
    assert os.path.exists(os.path.join(workdir, name)), name
  records = read_metrics(workdir)
  steps = lambda split: [r["step"] for r in records if r["split"] == split]
  assert steps("finetune") == steps("finetune_eval") == [4, 8, 12, 16] and steps("test") == [16]
  # learning_rate is the rate the logged step applied (the optimizer's count is the step before it),
  # not its window's mean: that would average warmup's rates into one never applied
  _, schedule = make_optimizer(ml_collections.ConfigDict(json.loads(open(os.path.join(workdir, "config.json")).read())))
  for r in (r for r in records if r["split"] == "finetune"):
    assert r["learning_rate"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-6), r
  evals = [r for r in records if r["split"] == "finetune_eval"]
  best = max(evals, key=lambda r: r["accuracy"])  # the first of the best (strict improvement)
  assert result["best_step"] == best["step"] and result["validation"]["accuracy"] == best["accuracy"]
  assert result["task"] == "stdlib:package" and result["num_classes"] == 4 and result["init"] == "pretrained"
  assert result["family"] == "decoder" and result["pooling"] == "last" and result["pretrained_step"] == 20
  assert set(result["test"]) == {"accuracy", "macro_f1", "loss"}
  assert {s: sum(v.values()) for s, v in result["class_balance"].items()} == result["sizes"]
  majority = result["baselines"]["majority"]
  assert majority["class"] in result["labels"]
  test_counts = result["class_balance"]["test"]
  assert majority["accuracy"] == pytest.approx(test_counts[majority["class"]] / result["sizes"]["test"])
  assert json.loads(open(os.path.join(workdir, "finetune_result.json")).read()) == result
  # a finished run is not scored again
  again = finetune.run(None, pretrained_decoder, "stdlib:package", workdir, overrides=SMOKE)
  assert again == result and len(scored) == 1 and steps("test") == [16]
  with pytest.raises(finetune.UserError, match="other settings.*finetune.steps"):
    finetune.run(None, pretrained_decoder, "stdlib:package", workdir, overrides=[*SMOKE, "finetune.steps=20"])
  # a fine-tune written before a model field existed (its config.json lacks it) is the same fine-tune
  path = os.path.join(workdir, "config.json")
  old = json.loads(open(path).read())
  del old["model"]["scan_unroll"], old["finetune"]["log_every"]
  open(path, "w").write(json.dumps(old))
  assert finetune.run(None, pretrained_decoder, "stdlib:package", workdir, overrides=SMOKE) == result


def test_finetune_resume_is_exact(tmp_path, pretrained_decoder, monkeypatch):
  """Interrupted after step 6 and resumed: the same metrics, result and best params as one run
  (dropout on, so the per-step keys matter too); the test split is scored once."""
  scored = count_test_scoring(monkeypatch)
  overrides = [*SMOKE, "model.dropout=0.1", "finetune.dropout=0.2", "finetune.log_every=2"]  # 6 = a log step
  full = finetune.run(None, pretrained_decoder, "stdlib:package", str(tmp_path / "full"), overrides=overrides)
  part = str(tmp_path / "part")
  first = finetune.run(None, pretrained_decoder, "stdlib:package", part, overrides=[*overrides, "finetune.stop_after=6"])
  assert first == {"status": "interrupted", "step": 6, "workdir": part}
  assert sorted(os.listdir(os.path.join(part, "checkpoints"))) == ["4", "6"]
  resumed = finetune.run(None, pretrained_decoder, "stdlib:package", part, overrides=overrides)
  assert {k: v for k, v in resumed.items() if k != "workdir"} == {k: v for k, v in full.items() if k != "workdir"}
  assert without_timing(read_metrics(part)) == without_timing(read_metrics(str(tmp_path / "full")))
  for x, y in zip(leaves(finetune.load_finetuned(part)[3]), leaves(finetune.load_finetuned(str(tmp_path / "full"))[3])):
    np.testing.assert_array_equal(x, y)
  assert len(scored) == 2  # once per workdir


def test_early_stopping_keeps_the_best_params(tmp_path, pretrained_decoder, monkeypatch):
  """Validation accuracies 0.3, 0.5, 0.4, 0.45 with patience 2: the run stops at the 4th
  evaluation (step 16 of 40), the best step is 8, and the test split is scored once with the
  params of step 8 (not the last ones)."""
  real_evaluate = finetune.evaluate_rows
  scored = count_test_scoring(monkeypatch, [0.3, 0.5, 0.4, 0.45])
  workdir = str(tmp_path / "stop")
  result = finetune.run(None, pretrained_decoder, "stdlib:package", workdir,
                        overrides=[*SMOKE, "finetune.steps=40", "finetune.patience=2"])
  assert result["stopped_early"] and result["steps_run"] == 16 and result["best_step"] == 8
  assert result["validation"]["accuracy"] == 0.5
  best, last = finetune.load_finetuned(workdir)[3], finetune.load_finetuned(workdir, which="last")[3]
  assert len(scored) == 1
  for x, y in zip(scored[0], leaves(best)):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(leaves(best), leaves(last)))
  # the best params are exactly the train state of step 8
  ref = str(tmp_path / "ref")
  monkeypatch.setattr(finetune, "evaluate_rows", real_evaluate)
  count_test_scoring(monkeypatch, [0.3, 0.5])
  finetune.run(None, pretrained_decoder, "stdlib:package", ref,
               overrides=[*SMOKE, "finetune.steps=40", "finetune.patience=2", "finetune.stop_after=8"])
  for x, y in zip(leaves(best), leaves(finetune.load_finetuned(ref, which="last")[3])):
    np.testing.assert_array_equal(x, y)


def test_a_diverging_finetune_stops_without_saving(tmp_path, pretrained_decoder):
  """A learning rate of 1e30 makes the fine-tune non-finite within its first evaluation period:
  it stops with one line, writes a `nonfinite` record, and saves no checkpoint (a bad state is
  never saved, and the evaluation that would pick it as the best never runs)."""
  workdir = str(tmp_path / "nan")
  with pytest.raises(finetune.UserError, match="non-finite.*no checkpoint was saved.*finetune.learning_rate"):
    finetune.run(None, pretrained_decoder, "stdlib:package", workdir,
                 overrides=[*SMOKE, "finetune.learning_rate=1e30", "finetune.log_every=1"])
  assert not os.listdir(os.path.join(workdir, "checkpoints"))
  records = read_metrics(workdir)
  assert [r["event"] for r in records if r["split"] == "event"] == ["nonfinite"]
  assert not [r for r in records if r["split"] == "finetune_eval"]


def test_finetune_encoder_on_the_pair_task(tmp_path, pretrained_encoder):
  """A BERT-style encoder (token types, [CLS] pooling) on stdlib:docstring: binary metrics with MCC."""
  result = finetune.run(None, pretrained_encoder, "stdlib:docstring", str(tmp_path / "pair"), overrides=[
      *SMOKE, "finetune.max_length=48", "finetune.select_metric=mcc"])
  assert result["pair"] and result["labels"] == ["mismatch", "match"] and result["pooling"] == "first"
  assert set(result["test"]) == {"accuracy", "macro_f1", "mcc", "loss"}
  assert abs(result["class_balance"]["train"]["match"] - result["class_balance"]["train"]["mismatch"]) <= 1
  setup = finetune.build(None, pretrained_encoder, "stdlib:docstring", str(tmp_path / "rows"), SMOKE)
  rows = setup.rows["train"]
  assert (rows.token_types == 1).any() and (rows.tokens[:, 0] == setup.exp.tokenizer.cls_id).all()


@pytest.mark.slow
def test_sharded_finetune_matches_one_device(tmp_path, pretrained_decoder):
  """The mesh config shards the fine-tune as it does pretraining: on 8 fake devices as 2 x 2 x 2
  (data, fsdp, tensor) the metrics equal those of one device."""
  one = str(tmp_path / "one")
  finetune.run(None, pretrained_decoder, "stdlib:package", one, overrides=SMOKE)
  eight = str(tmp_path / "eight")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "tfx.finetune", "--from", pretrained_decoder, "--task", "stdlib:package", "--workdir", eight,
       *[f"--config.{o}" for o in SMOKE], "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in proc.stdout
  a, b = without_timing(read_metrics(one)), without_timing(read_metrics(eight))
  assert [(r["split"], r["step"]) for r in a] == [(r["split"], r["step"]) for r in b]
  for x, y in zip(a, b):
    for key in x:
      if isinstance(x[key], float):
        assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (x, y)


@pytest.mark.slow
def test_cli_scratch_without_a_pretrained_run_and_errors(tmp_path, shared_tokenizer):
  flags = [f"--config.{o}" for o in SMOKE]
  proc = subprocess.run(
      [sys.executable, "-m", "tfx.finetune", "--from", "none", "--config", os.path.join(ROOT, "configs", "tiny.py"),
       "--task", "stdlib:package", "--workdir", str(tmp_path / "cli"), f"--config.data.tokenizer={shared_tokenizer}",
       *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "class balance" in proc.stdout and "majority" in proc.stdout and "random initialisation" in proc.stdout
  result = json.loads((tmp_path / "cli" / "finetune_result.json").read_text())
  assert result["init"] == "scratch" and result["from_workdir"] == ""
  for args, message in [(["--from", str(tmp_path / "nothing")], "is not a tfx run"),
                        (["--from", "none"], "needs --config"),
                        (["--from", str(tmp_path / "cli"), "--config.model.d_model=32"], "architecture and data")]:
    proc = subprocess.run([sys.executable, "-m", "tfx.finetune", "--task", "stdlib:package", "--workdir",
                           str(tmp_path / "bad"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- the acceptance property

# Measured on 2 CPU cores (configs/bert_tiny.py pretrained 600 steps of 32 x 64 tokens on the whole
# stdlib, then 300 fine-tuning steps of 32 examples on every train example of stdlib:package, 20
# classes): test accuracy pretrained 0.335 / 0.356 / 0.364 vs scratch 0.181 / 0.211 / 0.252 (seeds
# 0-2), mean difference 0.137, 95% CI [0.082, 0.191]. A tiny causal-LM decoder pretrained the same
# way does *not* beat its scratch baseline at this size (0.375 / 0.346 / 0.343 vs 0.364 / 0.347 /
# 0.361): the test uses the MLM encoder.
ACCEPTANCE = ("finetune.max_train_examples=0", "finetune.max_eval_examples=3000", "finetune.steps=300",
              "finetune.batch_size=32", "finetune.learning_rate=1e-3", "finetune.eval_every=100",
              "finetune.log_every=100", "finetune.patience=0")


@pytest.mark.slow
def test_pretrained_beats_scratch_on_stdlib_package(tmp_path):
  """Fine-tuning a pretrained encoder beats fine-tuning the same architecture from random weights
  on stdlib:package: over 3 seeds, the 95% confidence interval (Student t) of the mean paired
  difference in test accuracy lies above 0."""
  from scipy import stats

  pretrained = str(tmp_path / "pretrained")
  train.run(load_config(os.path.join(ROOT, "configs", "bert_tiny.py"), [
      "--config.data.max_documents=0", "--config.train.steps=600", "--config.train.batch_size=32",
      "--config.train.eval_every=0", "--config.train.checkpoint_every=600", "--config.train.log_every=100"]), pretrained)
  accuracy: dict[str, list[float]] = {"pretrained": [], "scratch": []}
  for seed in (0, 1, 2):
    for init in accuracy:
      result = finetune.run(None, pretrained, "stdlib:package", str(tmp_path / f"{init}_{seed}"),
                            overrides=[*ACCEPTANCE, f"finetune.seed={seed}", f"finetune.init={init}"])
      assert result["num_classes"] == 20 and result["init"] == init
      accuracy[init].append(result["test"]["accuracy"])
  diffs = np.array(accuracy["pretrained"]) - np.array(accuracy["scratch"])
  half = stats.t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / np.sqrt(len(diffs))
  print(f"test accuracy: pretrained {accuracy['pretrained']}, scratch {accuracy['scratch']}; difference "
        f"{diffs.mean():.3f}, 95% CI [{diffs.mean() - half:.3f}, {diffs.mean() + half:.3f}]")
  assert diffs.mean() - half > 0, (accuracy, diffs.mean(), half)
