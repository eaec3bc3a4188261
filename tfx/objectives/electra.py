"""ELECTRA replaced-token detection (Clark et al. 2020), OBJECTIVES.md-style spec in docs/objectives.md.

The model (an `encoder`) is the discriminator; the objective owns a small generator and the
discriminator's head (`init_params`, stored under `params["objective"]`):

    tokens      a  b  c  d  e  | pad
    selected    0  1  0  0  1  |  0        (mask_tokens: mask_rate, mask_token_rate, random_token_rate)
    gen input   a  M  c  d  M  | pad
    sampled     .  x  .  .  e  |           (generator softmax / temperature, the objective's key,
                                            no gradient through the sample)
    corrupted   a  x  c  d  e  | pad       (sampled at the selected positions, the original elsewhere)
    replaced    0  1  0  0  0  |  0        (exactly where corrupted != original: a correct sample is "original")

loss = generator MLM cross-entropy (mean over selected tokens)
       + rtd_weight (λ = 50) * discriminator sigmoid cross-entropy (mean over real tokens).

Shared embeddings, as ELECTRA's released code: the generator reads the discriminator's whole
embedding layer (token + position + type embeddings and their norm: `Encoder(...,
return_embeddings=True)`), projects it to its own width when narrower (`embed_project`), and its
MLM head (dense to the embedding width, activation, norm) scores against the discriminator's
token embedding table with its own output bias. The generator has the discriminator's depth and
`generator_size` times its width, heads and MLP width (the paper's 1/4 for small, 1/3 for base).
The discriminator head is dense (d -> d), activation, dense (d -> 1). As in ELECTRA's code, the
generator's work past its last layer's keys and values (that layer's queries and MLP, its head,
the sampling) runs only at each row's selected tokens, gathered into `max_predictions` slots
(`gather_predictions`; masked_lm's mechanism, `Stack`'s `rows`).

Export: `tfx.convert --to-hf`, `tfx.finetune` and `load_trained` read the discriminator (the
model's params); the generator and the head stay in the run's checkpoints (ELECTRA, too,
fine-tunes only the discriminator). The encoder's own MLM head is unused (no gradient).
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tfx import flops, ops
from tfx.nn import DenseGeneral, Stack, make_norm
from tfx.nn.layers import GATED, ModelConfig, activation, add_bias, gathered, project
from tfx.objectives.base import Objective, Predictions, flat_positions, split_params
from tfx.objectives.masked_lm import mask_tokens, prediction_slots, selected_positions
from tfx.registry import OBJECTIVES


def generator_config(cfg: ModelConfig, size: float) -> ModelConfig:
  """The generator's config: `size` times the discriminator's width, heads and MLP width, same depth."""
  heads = max(1, round(cfg.num_heads * size))
  d_model = round(cfg.d_model * size)
  return dataclasses.replace(cfg, d_model=d_model, num_heads=heads, head_dim=0, d_ff=max(1, round(cfg.d_ff * size)))


class Generator(nn.Module):
  """ELECTRA's generator on the discriminator's embeddings: [b, t, E] -> logits [b, t, v].

  cfg: the generator's config (`generator_config`); embed_dim: E, the discriminator's width.
  """

  cfg: ModelConfig
  embed_dim: int

  @nn.compact
  def __call__(self, embedded, segment_ids, positions, table, *, train: bool = False, rows=None):
    """embedded [b, t, E] (the shared embedding layer's output), segment_ids / positions [b, t],
    table [v, E] (the shared token embeddings) -> logits [b, t, v] in the compute dtype (the loss
    reads them in float32: `ops.weighted_cross_entropy`, whose gradient for bf16 logits is one
    hand-written pass, not autodiff's float32 copy and scatter). With `rows` [b, n]
    int: the logits at those positions only, [b, n, v]; the stack's last layer and the head then
    run there alone (`Stack`'s `rows`)."""
    cfg, e = self.cfg, self.embed_dim
    x = embedded
    if e != cfg.d_model:
      x = DenseGeneral((e,), (cfg.d_model,), ("embed", "mlp"), init_std=cfg.init_std, dtype=cfg.compute_dtype,
                       name="embed_project")(x)  # [b, t, g]
    mask = ops.self_attention_mask(segment_ids, causal=False, implementation=cfg.attention,
                                   packed_runs=cfg.packed_runs)
    x = Stack(cfg, cfg.num_layers, deterministic=not train, name="encoder")(
        x, mask, positions, segment_ids, None, rows=rows)  # [b, t|n, g]
    if cfg.norm == "pre":
      x = make_norm(cfg, "final_norm")(x)
    act = activation("gelu" if cfg.mlp in GATED else cfg.mlp)
    h = DenseGeneral((cfg.d_model,), (e,), ("mlp", "embed"), init_std=cfg.init_std, dtype=cfg.compute_dtype,
                     name="head_dense")(x)  # [b, t, E]
    h = make_norm(cfg, "head_norm")(act(h))
    bias = self.param("output_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                      (table.shape[0],), jnp.float32)
    table = gathered(table, ("vocab", "embed"), cfg.compute_dtype)  # as FSDP reads it
    logits = project(h.astype(cfg.compute_dtype), table, True)  # [b, t, v]; the table's gradient in float32
    return add_bias(logits, bias, True)  # `wide`: the vocabulary


class DiscriminatorHead(nn.Module):
  """[b, t, d] hidden -> [b, t] replaced-token logits: dense, activation, dense to 1."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, hidden):
    cfg = self.cfg
    act = activation("gelu" if cfg.mlp in GATED else cfg.mlp)
    h = act(DenseGeneral((cfg.d_model,), (cfg.d_model,), ("embed", "mlp"), init_std=cfg.init_std,
                         dtype=cfg.compute_dtype, name="dense")(hidden))
    out = DenseGeneral((cfg.d_model,), (1,), ("mlp", None), init_std=cfg.init_std, dtype=cfg.compute_dtype,
                       name="out")(h)  # [b, t, 1]
    return out[..., 0].astype(jnp.float32)


def at_slots(base: jax.Array, where: jax.Array, values: jax.Array) -> jax.Array:
  """`base` [b, t, ...] with `values` [b, n, ...] written at positions `where` [b, n] (a row's
  slots are distinct positions, `selected_positions`)."""
  return base.at[jnp.arange(base.shape[0])[:, None], where].set(values)


def sample_rows(rng: jax.Array, logits: jax.Array, temperature: float) -> jax.Array:
  """One sample per position from softmax(logits / temperature), row r from split(rng, b)[r]:
  logits [b, t, v] -> [b, t] int32. No gradient flows through it."""
  logits = jax.lax.stop_gradient(logits).astype(jnp.float32) / temperature  # bf16 logits sampled in float32
  keys = jax.random.split(rng, logits.shape[0])
  return jax.vmap(lambda k, row: jax.random.categorical(k, row, axis=-1))(keys, logits).astype(jnp.int32)


@OBJECTIVES.register("electra")
@dataclasses.dataclass(frozen=True)
class Electra(Objective):
  """ELECTRA replaced-token detection: a small MLM generator corrupts the row, the model (the
  discriminator) predicts which tokens were replaced; generator and model share embeddings."""

  # Probability that an eligible token is selected for the generator to fill (ELECTRA: 0.15; 0.25 for large).
  mask_rate: float = 0.15
  # Share of the selected tokens shown to the generator as <mask> (ELECTRA: 0.85; the rest kept).
  mask_token_rate: float = 0.85
  # Share shown as a random ordinary token (ELECTRA: 0).
  random_token_rate: float = 0.0
  # Generator width, heads and MLP width as a fraction of the model's (paper: 1/4 small, 1/3 base).
  generator_size: float = 0.25
  # Weight λ of the discriminator's loss against the generator's MLM loss (paper: 50).
  rtd_weight: float = 50.0
  # Temperature of the generator's softmax when sampling replacements.
  temperature: float = 1.0
  # At most this many selected tokens per row (ELECTRA's max_predictions_per_seq); beyond it the
  # ones with the largest draws stay unselected. 0 = automatic, as masked_lm's: the mean + 4
  # standard deviations of the row's Binomial(seq_len, mask_rate) count, a multiple of 8.
  max_predictions: int = 0
  # The generator's last layer, MLM head and sampling run on the selected tokens only, gathered
  # into max_predictions slots per row (as ELECTRA's own code gathers them), instead of at every
  # position: the same generator loss.
  gather_predictions: bool = True

  families = ("encoder",)

  def __post_init__(self):
    for name in ("mask_rate", "mask_token_rate", "random_token_rate"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"objective.{name} must be in [0, 1], got {getattr(self, name)}")
    if self.mask_token_rate + self.random_token_rate > 1.0:
      raise ValueError("objective.mask_token_rate + objective.random_token_rate must be <= 1")
    if not 0.0 < self.generator_size <= 1.0:
      raise ValueError(f"objective.generator_size must be in (0, 1], got {self.generator_size}")
    if self.max_predictions < 0:
      raise ValueError(f"objective.max_predictions must be >= 0 (0 = automatic), got {self.max_predictions}")
    if self.temperature <= 0.0 or self.rtd_weight < 0.0:
      raise ValueError("objective.temperature must be > 0 and objective.rtd_weight >= 0")
    if self.ids.mask is None:
      raise ValueError("electra needs a [MASK] id, but the tokenizer has none")

  @classmethod
  def check_config(cls, config) -> list[str]:
    problems = super().check_config(config)
    m = config.model
    if m.position == "relative":
      problems.append("objective electra: the generator has no relative-position bias; use model.position "
                      "learned, sinusoidal or rotary")
    size = config.objective.get("generator_size", 0.25)
    heads, d = max(1, round(m.num_heads * size)), round(m.d_model * size)
    if d < 1 or d % heads:
      problems.append(f"objective.generator_size={size}: the generator's d_model {d} must be a positive multiple "
                      f"of its {heads} heads; choose a size that keeps model.d_model * size divisible")
    return problems

  def prediction_slots(self, length: int) -> int:
    """The cap on selected tokens per row of `length` (`max_predictions`, 0 = automatic)."""
    return prediction_slots(length, self.mask_rate, self.max_predictions)

  def generator_slots(self, length: int) -> int | None:
    """The generator's slots per row when it runs at the selected tokens only
    (`gather_predictions`, fewer slots than positions), else None (every position)."""
    slots = self.prediction_slots(length)
    return slots if self.gather_predictions and slots < length else None

  def generator(self, cfg: ModelConfig) -> Generator:
    return Generator(generator_config(cfg, self.generator_size), cfg.d_model)

  def init_params(self, rng, model, seq_len):
    cfg = model.cfg
    gen_rng, head_rng = jax.random.split(rng)
    x = jnp.zeros((1, seq_len, cfg.d_model), cfg.compute_dtype)
    segment_ids = jnp.ones((1, seq_len), jnp.int32)
    positions = jnp.arange(seq_len, dtype=jnp.int32)[None]
    table = jnp.zeros((cfg.vocab_size, cfg.d_model), jnp.float32)
    generator = self.generator(cfg).init({"params": gen_rng}, x, segment_ids, positions, table)["params"]
    head = DiscriminatorHead(cfg).init({"params": head_rng}, x)["params"]
    return {"generator": generator, "discriminator_head": head}

  def _forward(self, model, params, batch, rng, *, train):
    """Everything of one step: a dict of [b, t] arrays (and `where`, the generator's slots' positions
    [b, n], or None when it runs everywhere), the generator's logits [b, n|t, v] and the
    discriminator's [b, t]."""
    disc, own = split_params(params)
    tokens, segment_ids, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
    mask_rng, sample_rng, gen_drop, disc_drop = jax.random.split(rng, 4)
    inputs, _, selected, kept = mask_tokens(
        tokens, segment_ids, mask_rng, ids=self.ids, mask_rate=self.mask_rate, mask_token_rate=self.mask_token_rate,
        random_token_rate=self.random_token_rate, max_selected=self.prediction_slots(tokens.shape[1]),
        return_kept=True)  # [b, t] each
    slots = self.generator_slots(tokens.shape[1])
    where = None if slots is None else selected_positions(selected, slots)  # [b, n]
    embedded = model.apply({"params": disc}, inputs, segment_ids, positions, train=train, return_embeddings=True,
                           rngs={"dropout": gen_drop})  # [b, t, d], the shared embedding layer
    gen_logits = self.generator(model.cfg).apply(
        {"params": own["generator"]}, embedded, segment_ids, positions, disc["token_embed"]["embedding"],
        train=train, rngs={"dropout": gen_drop}, rows=where)  # [b, n|t, v]
    sampled = sample_rows(sample_rng, gen_logits, self.temperature)  # [b, n|t]
    if where is not None:  # each slot's sample at its position
      sampled = at_slots(jnp.asarray(tokens, jnp.int32), where, sampled)  # [b, t]
    corrupted = jnp.where(selected > 0, sampled, tokens).astype(jnp.int32)
    replaced = (corrupted != tokens) & (segment_ids > 0)  # [b, t]
    hidden = model.apply({"params": disc}, corrupted, segment_ids, positions, train=train, return_hidden=True,
                         rngs={"dropout": disc_drop})  # [b, t, d]
    disc_logits = DiscriminatorHead(model.cfg).apply({"params": own["discriminator_head"]}, hidden)  # [b, t]
    out = {"selected": selected, "kept": kept, "sampled": sampled, "corrupted": corrupted, "replaced": replaced,
           "where": where}
    return out, gen_logits, disc_logits

  def loss(self, model, params, batch, rng, *, train):
    out, gen_logits, disc_logits = self._forward(model, params, batch, rng, train=train)
    targets, weights = batch["tokens"], out["selected"]  # [b, t]
    if out["where"] is not None:  # [b, n]: the generator's slots
      targets, weights = (jnp.take_along_axis(a, out["where"], axis=1) for a in (targets, weights))
    mlm_loss, mlm = ops.weighted_cross_entropy(gen_logits, targets, weights, z_loss=self.z_loss)
    real = (batch["segment_ids"] > 0).astype(jnp.float32)  # [b, t]
    labels = out["replaced"].astype(jnp.float32)
    n = jnp.maximum(jnp.sum(real), 1.0)
    rtd_loss = jnp.sum(optax.sigmoid_binary_cross_entropy(disc_logits, labels) * real) / n
    correct = ((disc_logits > 0) == out["replaced"]).astype(jnp.float32)
    loss = mlm_loss + self.rtd_weight * rtd_loss
    return loss, {"loss": loss, "accuracy": jnp.sum(correct * real) / n, "num_tokens": jnp.sum(real),
                  "mlm_loss": mlm_loss, "mlm_accuracy": mlm["accuracy"], "mlm_tokens": mlm["num_tokens"],
                  "rtd_loss": rtd_loss, "replaced_rate": jnp.sum(labels * real) / n}

  def metric_counts(self) -> dict[str, str]:
    return {"mlm_loss": "mlm_tokens", "mlm_accuracy": "mlm_tokens"}  # the rest: real tokens (num_tokens)

  def loss_terms(self) -> dict[str, float]:
    return {"mlm_loss": 1.0, "rtd_loss": self.rtd_weight}

  def predictions(self, model, params, batch, rng):
    """2t slots per row: slots [0, t) are the generator's MLM predictions of the selected tokens
    (the kept ones see themselves); slots [t, 2t) the discriminator's replaced/original
    predictions at every real token, its logit in column 0 (the rest zeros), the source being
    the token it judges. A discriminator slot sees its own token where it was not selected (it is
    shown as is) or kept for the generator; at a selected position it sees only the sample."""
    out, gen_logits, disc_logits = self._forward(model, params, batch, rng, train=False)
    if out["where"] is not None:  # the slots' logits back at their positions (zeros elsewhere: weight 0)
      zeros = jnp.zeros(batch["tokens"].shape + gen_logits.shape[-1:], gen_logits.dtype)  # [b, t, v]
      gen_logits = at_slots(zeros, out["where"], gen_logits)
    real = batch["segment_ids"] > 0
    disc_slots = jnp.zeros_like(gen_logits).at[..., 0].set(disc_logits)  # [b, t, v]
    source = flat_positions(batch["segment_ids"])
    selected = out["selected"] > 0
    return Predictions(
        logits=jnp.concatenate([gen_logits, disc_slots], axis=1),
        targets=jnp.concatenate([batch["tokens"], out["replaced"].astype(jnp.int32)], axis=1),
        weights=jnp.concatenate([out["selected"], real.astype(jnp.float32)], axis=1),
        source=jnp.concatenate([source, source], axis=1),
        sees_self=jnp.concatenate([out["kept"], ~selected | out["kept"]], axis=1))

  def loss_from_predictions(self, predictions: Predictions) -> jax.Array:
    """The generator's cross entropy over slots [0, t) plus λ times the discriminator's binary
    cross entropy over slots [t, 2t) (logit in column 0, target 1 = replaced)."""
    p, t = predictions, predictions.logits.shape[1] // 2
    mlm, _ = ops.weighted_cross_entropy(p.logits[:, :t], p.targets[:, :t], p.weights[:, :t], z_loss=self.z_loss)
    real = p.weights[:, t:]  # [b, t]
    bce = optax.sigmoid_binary_cross_entropy(p.logits[:, t:, 0], p.targets[:, t:].astype(jnp.float32))
    return mlm + self.rtd_weight * jnp.sum(bce * real) / jnp.maximum(jnp.sum(real), 1.0)

  def initial_loss(self, vocab_size: int) -> float:
    """ln(vocabulary) for the generator plus λ ln 2 for the discriminator's coin flips."""
    return super().initial_loss(vocab_size) + self.rtd_weight * math.log(2.0)

  def train_flops_per_row(self, model_cfg, seq_len: int) -> float:
    """3x the forward of: the discriminator stack and head (no vocabulary projection), and the
    generator: the projection from the shared embeddings and its stack at every position, its last
    layer past the keys and values, its head to the embedding width and the vocabulary projection
    at the n gathered slots (every position without `gather_predictions`)."""
    t, e, v = seq_len, model_cfg.d_model, model_cfg.vocab_size
    n = self.generator_slots(seq_len) or t
    g = generator_config(model_cfg, self.generator_size)
    layer = lambda c, queries: flops.attention_flops(c, queries, t) + 2 * queries * flops.mlp_params(c)
    disc = model_cfg.num_layers * layer(model_cfg, t) + 2 * t * (e * e + e)
    project = 2 * t * g.d_model * e if g.d_model != e else 0
    gen = (g.num_layers - 1) * layer(g, t) + layer(g, n) + project + 2 * n * g.d_model * e + 2 * n * e * v
    return 3 * (disc + gen)
