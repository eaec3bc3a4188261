"""DistilBERT-style distillation (Sanh et al. 2019): a frozen teacher encoder, a student trained on
its soft targets, on masked LM and on the direction of its hidden states.

Both models read the same masked row (masked_lm's masking: 15%, 80/10/10). With student logits
s, teacher logits t, temperature T, student / teacher final hidden states h_s / h_t, over the
real tokens R and the selected tokens M of the batch:

    soft   = T^2 * mean_{i in R} [ -sum_v softmax(t_i / T)_v * log softmax(s_i / T)_v ]
    mlm    = mean_{i in M} [ -log softmax(s_i)_{token_i} ]
    cosine = mean_{i in R} [ 1 - cos(h_s,i, h_t,i) ]
    loss   = ce_weight * soft + mlm_weight * mlm + cos_weight * cosine      (DistilBERT: 5, 2, 1; T = 2)

The teacher (`teacher`):
  - a tfx run directory: its config.json, tokenizer and latest checkpoint (`tfx.runs`; the
    model's parameters only);
  - `hf:DIR`: an HF `save_pretrained` encoder directory, read through `tfx.convert`'s importer;
  - `init`: a teacher of the student's architecture at random initialisation from
    `teacher_seed` (smoke tests and `tfx.check_objective` only).
Its vocabulary must be the student's (the same tokenizer) and its width the student's (the cosine
loss compares hidden states); it may be deeper. It is loaded once, placed on the run's mesh by the
logical axis rules (`load_frozen`), passed to the jitted train / eval steps as an argument
(`frozen_inputs`), never optimised, and never written to the student's checkpoints. The
student's initialisation from the teacher's layers (DistilBERT takes every other layer) is not
done here.
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from tfx import flops, ops, parallel
from tfx.errors import UserError
from tfx.objectives.base import Predictions, flat_positions
from tfx.objectives.masked_lm import MaskedLM, logits_and_hidden
from tfx.objectives.options import internal
from tfx.registry import OBJECTIVES


def _init_and_shardings(model, mesh, seq_len: int):
  """(init: rng -> boxed parameters, their abstract values (boxed), their shardings on `mesh`) of
  `model`."""
  inputs = type(model).init_inputs(1, seq_len)
  init = lambda rng: model.init({"params": rng, "dropout": rng}, **inputs)["params"]
  key = jax.random.key(0)  # made outside the mesh's context: its devices may be a compile-only topology's
  with parallel.context(mesh):
    abstract = jax.eval_shape(init, key)
  return init, abstract, parallel.logical_to_sharding(abstract, mesh)


def sharded_init(model, mesh, seed: int, seq_len: int):
  """`model`'s parameters at initialisation from `seed`, created sharded on `mesh`."""
  init, _, shardings = _init_and_shardings(model, mesh, seq_len)
  with parallel.context(mesh):
    return jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=shardings)(jax.random.key(seed))


def abstract_params(model, mesh, seq_len: int):
  """`model`'s parameters as `jax.ShapeDtypeStruct`s with their shardings on `mesh`: nothing
  initialised, loaded or placed."""
  _, abstract, shardings = _init_and_shardings(model, mesh, seq_len)
  return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), nn.unbox(abstract),
                      shardings)


@functools.lru_cache(maxsize=8)
def _hf_teacher(path: str):
  """(config, numpy params) of an HF directory, read once per process."""
  from tfx.convert.hf_import import from_hf

  return from_hf(path)


@functools.lru_cache(maxsize=8)
def _run_teacher(path: str):
  """(config, tokenizer) of a tfx run, read once per process."""
  from tfx.runs import load_run

  return load_run(path)


def teacher_model(teacher: str, student):
  """The teacher's module (the student's own for `init`)."""
  from tfx.models import build_model

  if teacher == "init":
    return student
  if teacher.startswith("hf:"):
    config, _ = _hf_teacher(teacher[3:])
    return build_model(config.model, vocab_size=config.data.vocab_size, max_length=config.data.seq_len)
  config, tokenizer = _run_teacher(teacher)
  return build_model(config.model, vocab_size=tokenizer.vocab_size, max_length=config.data.seq_len)


@OBJECTIVES.register("distillation")
@dataclasses.dataclass(frozen=True)
class Distillation(MaskedLM):
  """DistilBERT: the student learns a frozen teacher's soft targets at a temperature, masked LM
  and the direction of the teacher's hidden states, on the same masked rows."""

  # The teacher: a tfx run directory, hf:DIR (an HF encoder via tfx.convert), or init (random, for checks).
  teacher: str = ""
  # Seed of the `init` teacher.
  teacher_seed: int = 1
  # Softmax temperature of the soft targets (DistilBERT: 2).
  temperature: float = 2.0
  # Weight of the soft-target cross-entropy (DistilBERT: 5).
  ce_weight: float = 5.0
  # Weight of the masked-LM cross-entropy (DistilBERT: 2).
  mlm_weight: float = 2.0
  # Weight of the hidden states' cosine loss (DistilBERT: 1).
  cos_weight: float = 1.0
  # The soft targets need the logits at every real token: masked_lm's gather does not apply.
  gather_predictions: bool = internal(False)

  frozen_inputs = True

  def __post_init__(self):
    super().__post_init__()
    if self.temperature <= 0:
      raise ValueError(f"objective.temperature must be > 0, got {self.temperature}")
    if min(self.ce_weight, self.mlm_weight, self.cos_weight) < 0:
      raise ValueError("objective.ce_weight, mlm_weight and cos_weight must be >= 0")

  @classmethod
  def check_config(cls, config) -> list[str]:
    problems = super().check_config(config)
    teacher = config.objective.get("teacher", "")
    if not teacher:
      problems.append("objective distillation needs a teacher: --config.objective.teacher=RUN_DIR (a tfx run), "
                      "hf:DIR (an HF save_pretrained encoder) or init (a random teacher, for checks)")
    elif teacher != "init":
      path = epath.Path(teacher[3:] if teacher.startswith("hf:") else teacher)
      if not (path / "config.json").exists():
        problems.append(f"objective.teacher={teacher!r}: {path} has no config.json; give a tfx run directory "
                        f"or hf:DIR of an HF save_pretrained directory")
    return problems

  def abstract_frozen(self, model, mesh):
    """The teacher's parameters' shapes and shardings on `mesh`, read from its config alone (the
    checks of `load_frozen`)."""
    return abstract_params(self._checked_teacher(model), mesh, model.cfg.max_length)

  def _checked_teacher(self, model):
    """The teacher's module, checked against the student: vocabulary, width, family."""
    teacher = teacher_model(self.teacher, model)
    s, t = model.cfg, teacher.cfg
    if t.family != "encoder":
      raise UserError(f"objective.teacher={self.teacher!r} is a {t.family!r} model; distillation needs an encoder")
    if (t.vocab_size, t.d_model) != (s.vocab_size, s.d_model):
      raise UserError(f"objective.teacher={self.teacher!r} has vocabulary {t.vocab_size} and d_model {t.d_model}; "
                      f"the student has {s.vocab_size} and {s.d_model}: they must match (same tokenizer, same width)")
    if t.max_length < s.max_length and t.position == "learned":
      raise UserError(f"objective.teacher={self.teacher!r} has {t.max_length} positions, fewer than the student's "
                      f"data.seq_len={s.max_length}; lower data.seq_len")
    return teacher

  def load_frozen(self, model, mesh):
    """The teacher's parameters on `mesh` (checked against the student: vocabulary, width, family)."""
    teacher, s = self._checked_teacher(model), model.cfg
    if self.teacher == "init":
      return sharded_init(model, mesh, self.teacher_seed, s.max_length)
    _, _, shardings = _init_and_shardings(teacher, mesh, 8)
    if self.teacher.startswith("hf:"):
      _, params = _hf_teacher(self.teacher[3:])
      return jax.tree.map(lambda a, sh: jax.device_put(np.asarray(a, np.float32), sh), params, shardings)
    from tfx.runs import restore_params

    config, tokenizer = _run_teacher(self.teacher)
    params, _ = restore_params(self.teacher, config, tokenizer, teacher, mesh)
    return params

  def _forward(self, model, params, batch, rng, frozen, *, train):
    mask_rng, dropout_rng = jax.random.split(rng)
    inputs, targets, weights, kept = self.mask(batch, mask_rng, return_kept=True)  # [b, t] each
    segment_ids, positions = batch["segment_ids"], batch["positions"]
    # The logits in the compute dtype: the losses read them in float32 themselves (bf16 ones get
    # one-pass gradients: `ops.soft_cross_entropy`, `ops.weighted_cross_entropy`).
    student_logits, student_hidden = logits_and_hidden(model, params, inputs, segment_ids, positions, train=train,
                                                       rngs={"dropout": dropout_rng},
                                                       float32_logits=False)  # [b, t, v], [b, t, e]
    teacher = teacher_model(self.teacher, model)
    teacher_logits, teacher_hidden = jax.lax.stop_gradient(
        logits_and_hidden(teacher, frozen, inputs, segment_ids, positions, train=False, float32_logits=False))
    return (inputs, targets, weights, kept), (student_logits, student_hidden), (teacher_logits, teacher_hidden)

  def loss(self, model, params, batch, rng, *, train, frozen):
    (_, targets, weights, _), (s, hs), (t, ht) = self._forward(model, params, batch, rng, frozen, train=train)
    real = (batch["segment_ids"] > 0).astype(jnp.float32)  # [b, t]
    n = jnp.maximum(jnp.sum(real), 1.0)
    temp = self.temperature
    soft = temp**2 * jnp.sum(ops.soft_cross_entropy(s, t, temp) * real) / n
    mlm_loss, mlm = ops.weighted_cross_entropy(s, targets, weights, z_loss=self.z_loss)
    hs, ht = hs.astype(jnp.float32), ht.astype(jnp.float32)
    cos = jnp.sum(hs * ht, -1) / jnp.maximum(jnp.linalg.norm(hs, axis=-1) * jnp.linalg.norm(ht, axis=-1), 1e-8)
    cosine = jnp.sum((1.0 - cos) * real) / n
    loss = self.ce_weight * soft + self.mlm_weight * mlm_loss + self.cos_weight * cosine
    return loss, {"loss": loss, "accuracy": mlm["accuracy"], "num_tokens": jnp.sum(real), "soft_loss": soft,
                  "mlm_loss": mlm_loss, "mlm_tokens": mlm["num_tokens"], "cos_loss": cosine,
                  "teacher_agreement": jnp.sum((jnp.argmax(s, -1) == jnp.argmax(t, -1)) * real) / n}

  def metric_counts(self) -> dict[str, str]:
    return {"mlm_loss": "mlm_tokens", "accuracy": "mlm_tokens"}  # the rest: real tokens (num_tokens)

  def loss_terms(self) -> dict[str, float]:
    return {"soft_loss": self.ce_weight, "mlm_loss": self.mlm_weight, "cos_loss": self.cos_weight}

  def predictions(self, model, params, batch, rng, *, frozen):
    """Every real token's student logits (the soft targets train them all): a selected token is
    predicted without seeing itself (unless kept); an unselected one is shown as is."""
    (_, targets, weights, kept), (s, _), _ = self._forward(model, params, batch, rng, frozen, train=False)
    real = batch["segment_ids"] > 0
    return Predictions(s, targets, real.astype(jnp.float32), flat_positions(batch["segment_ids"]),
                       sees_self=(weights == 0) | kept)

  def loss_from_predictions(self, predictions: Predictions) -> None:
    """None: the soft and cosine terms read the teacher, which predictions do not carry."""
    return None

  def initial_loss(self, vocab_size: int) -> float:
    """Random student and teacher: both softmaxes near uniform (ln v for the soft and MLM terms) and
    unrelated hidden states (cosine near 0)."""
    return (self.ce_weight * self.temperature**2 + self.mlm_weight) * math.log(vocab_size) + self.cos_weight

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """The student's forward and backward (3x forward) plus the teacher's forward: at the teacher
    run's config when its config.json is readable, else at the student's size."""
    teacher_cfg = model_cfg
    if self.teacher and self.teacher != "init" and not self.teacher.startswith("hf:"):
      path = epath.Path(self.teacher) / "config.json"
      if path.exists():
        from tfx import config as config_lib
        from tfx.nn.layers import ModelConfig

        c = config_lib.from_json(path.read_text())
        teacher_cfg = ModelConfig.from_config(c.model, vocab_size=model_cfg.vocab_size, max_length=seq_len)
    return 3 * flops.row_forward_flops(model_cfg, seq_len) + flops.row_forward_flops(teacher_cfg, seq_len)
