"""Decoding with a KV cache: greedy, temperature, top-k and top-p sampling.

    python -m tfx.generate --workdir runs/quickstart --prompt "def main(" [--max-new-tokens 64
        --temperature 0.8 --top-k 40 --top-p 0.95 --seed 0 --num-samples 2]

How it works. The decoder is trained on rows shifted right with BOS at each document start
(tfx/objectives/causal_lm.py), so generation feeds `[BOS] + prompt` and reads the prediction
of the next token at the last fed position.

- Static shapes: the KV cache ("cache" collection of the model, see tfx/nn/attention.py) holds
  `model.cfg.max_length` tokens; the (left-padded) prompt plus the new tokens must fit in it.
- The prompt fills the cache in one call of `decode_step` (causally, or bidirectionally for a
  model trained as a prefix LM: `Objective.bidirectional_prompt`); then one compiled step feeds
  one token per row and returns the next-token logits, run by a `jax.lax.scan` over the
  generated tokens, so it is traced (and compiled) once, whatever the number of new tokens.
- Prompts of different lengths share a batch by left padding: `prompt_segment_ids` is 0 on
  padding and 1 on real tokens. Padding is written to the cache with segment 0, so no real
  token ever attends to it. Positions count from 0 at each row's first real token.
- After a row emits `eos_id`, its remaining outputs are `pad_id` (default: `eos_id` again).
"""

import argparse
import functools
import math
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfx import ops
from tfx.errors import UserError
from tfx.registry import OBJECTIVES

Params = Any
Cache = Any


# ============================================================================ sampling


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
  """Keeps the k largest logits of each row (ties with the k-th kept too); the rest -> -inf.

  Args:
    logits: [b, v] float.
    k: number of tokens to keep; 0 (or >= v) keeps all.
  Returns:
    [b, v] float.
  """
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][:, -1:]  # [b, 1]
  return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
  """Nucleus filtering: keeps the smallest set of most likely tokens whose probability reaches p.

  A token is kept iff the probability of the tokens strictly more likely than it (in sorted
  order) is below p; so the most likely token is always kept.

  Args:
    logits: [b, v] float (may hold -inf from an earlier filter).
    p: probability mass in (0, 1]; 1.0 keeps all.
  Returns:
    [b, v] float, filtered logits -> -inf.
  """
  if p >= 1.0:
    return logits
  b = logits.shape[0]
  order = jnp.argsort(-logits, axis=-1)  # [b, v], most likely first
  sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)  # [b, v]
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # [b, v]
  keep_sorted = mass_before < p  # [b, v]
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(b)[:, None], order].set(keep_sorted)  # [b, v]
  return jnp.where(keep, logits, -jnp.inf)


def sample_next(logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0) -> jax.Array:
  """The next token of each row: argmax if temperature == 0, else a filtered softmax sample.

  Args:
    logits: [b, v] float.
    rng: PRNG key.
    temperature: 0 = greedy; otherwise sample from softmax(logits / temperature).
    top_k: keep the k most likely tokens before sampling (0 = off).
    top_p: keep the smallest set whose probability reaches top_p (1.0 = off).
  Returns:
    [b] int32.
  """
  logits = logits.astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = top_p_filter(top_k_filter(logits / temperature, top_k), top_p)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# ============================================================================ the decode step


def init_cache(model: nn.Module, batch: int) -> Cache:
  """An empty KV cache for `batch` rows of `model.cfg.max_length` tokens (zeros, index 0).

  The shapes come from `model.init(..., decode=True)` on a full-length dummy input, traced
  with `jax.eval_shape` so no parameters are computed. Scanned layers give every cache
  variable a leading layers axis.
  """
  inputs = type(model).init_inputs(batch, model.cfg.max_length)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), **inputs, decode=True))["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decode_step(model: nn.Module, params: Params, cache: Cache, token: jax.Array, position: jax.Array,
                segment: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, Cache]:
  """Feeds t tokens per row through the model with the KV cache (t = 1 when decoding, the whole
  prompt when filling the cache).

  Args:
    model: a decoder family module.
    params: its parameters.
    cache: the "cache" collection (from `init_cache` or a previous step).
    token, position, segment: [b, t] int32; segment 0 marks a padding token.
    mask: [b, 1, t, max_length] bool over the cache's slots, or None for the cache's causal mask.
  Returns:
    (logits [b, v] float32 of the token after the last one, the updated cache).
  """
  logits, variables = model.apply(
      {"params": params, "cache": cache}, token, segment, position, decode=True, mask=mask, mutable=["cache"])
  return logits[:, -1], variables["cache"]  # [b, v]


def prompt_mask(segment_ids: jax.Array, max_length: int) -> jax.Array:
  """[b, p] -> [b, 1, p, max_length] bool: a prompt filling an empty cache attends all of itself
  (a prefix-LM's bidirectional prefix), never the empty slots after it or left padding."""
  cached = jnp.pad(segment_ids, ((0, 0), (0, max_length - segment_ids.shape[1])))  # [b, max_length]
  return ops.segment_mask(segment_ids, cached)


def prompt_positions(segment_ids: jax.Array) -> jax.Array:
  """[b, p] -> [b, p] int32: 0, 1, ... from each row's first real token (0 on padding)."""
  real = (segment_ids > 0).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(real, axis=-1) - 1, 0) * real


def check_fits(model: nn.Module, prompt_length: int, max_new_tokens: int) -> None:
  """Raises UserError if the prompt and the new tokens do not fit in the cache.

  The cache holds every fed token: the prompt and all new tokens but the last one.
  """
  if prompt_length < 1:
    raise UserError("the prompt is empty; it needs at least the BOS token")
  if max_new_tokens < 1:
    raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1")
  room = model.cfg.max_length
  if prompt_length > room:
    raise UserError(f"the prompt has {prompt_length} tokens but the model's maximum length (data.seq_len) is "
                    f"{room}: no token can follow it; shorten the prompt to at most {room} tokens")
  if prompt_length + max_new_tokens - 1 > room:
    raise UserError(
        f"prompt of {prompt_length} tokens + {max_new_tokens} new tokens does not fit in the model's "
        f"maximum length {room} (the KV cache and position table size, data.seq_len): at most "
        f"{room - prompt_length + 1} new tokens can follow this prompt; shorten the prompt or ask for fewer")


# ============================================================================ generation


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "eos_id", "pad_id", "bidirectional_prompt"))
def generate(model: nn.Module, params: Params, prompt: jax.Array, prompt_segment_ids: jax.Array, rng: jax.Array,
             *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | None = None, pad_id: int | None = None, bidirectional_prompt: bool = False) -> jax.Array:
  """Continues each prompt row by `max_new_tokens` tokens, with a KV cache.

  The prompt fills the cache in one call, then each new token is one step.

  Args:
    model: a decoder family module (`model.cfg.max_length` sizes the cache).
    params: its parameters.
    prompt: [b, p] int32, left-padded, each row `[BOS] + prompt tokens`.
    prompt_segment_ids: [b, p] int32, 0 on left padding, 1 on real tokens (every row needs
      at least one real token).
    rng: PRNG key (unused when greedy).
    max_new_tokens: tokens to generate; p + max_new_tokens - 1 <= model.cfg.max_length.
    temperature, top_k, top_p: see `sample_next`.
    eos_id: a row that emits it is finished; None = never finish early.
    pad_id: the output after EOS (default: eos_id).
    bidirectional_prompt: the prompt attends all of itself (a model trained with a prefix-LM
      objective, whose `[BOS] + prefix` is bidirectional); the new tokens attend causally.
  Returns:
    [b, max_new_tokens] int32; after a row's EOS, the remaining entries are pad_id.
  Raises:
    UserError: the prompt and the new tokens do not fit in the cache.
  """
  b, p = prompt.shape
  check_fits(model, p, max_new_tokens)
  pad_id = eos_id if pad_id is None else pad_id
  prompt = prompt.astype(jnp.int32)
  prompt_segment_ids = prompt_segment_ids.astype(jnp.int32)
  positions = prompt_positions(prompt_segment_ids)  # [b, p]
  sample = lambda logits, i: sample_next(logits, jax.random.fold_in(rng, i), temperature=temperature, top_k=top_k,
                                         top_p=top_p)  # the key of step i: new token j is step p - 1 + j

  def finish(new, finished):
    if eos_id is None:
      return new, finished
    new = jnp.where(finished, pad_id, new)
    return new, finished | (new == eos_id)

  mask = prompt_mask(prompt_segment_ids, model.cfg.max_length) if bidirectional_prompt else None
  logits, cache = decode_step(model, params, init_cache(model, b), prompt, positions, prompt_segment_ids, mask)
  first, finished = finish(sample(logits, p - 1), jnp.zeros((b,), bool))  # [b]

  def body(carry, i):
    cache, token, position, finished = carry
    logits, cache = decode_step(model, params, cache, token[:, None], position[:, None], jnp.ones((b, 1), jnp.int32))
    new, finished = finish(sample(logits, i), finished)
    return (cache, new, position + 1, finished), new

  next_position = jnp.max(positions, axis=-1) + 1  # [b]
  carry = (cache, first, next_position, finished)
  _, rest = jax.lax.scan(body, carry, jnp.arange(p, p + max_new_tokens - 1))  # [max_new_tokens - 1, b]
  return jnp.concatenate([first[:, None], rest.T], axis=1)  # [b, max_new_tokens]


def greedy_by_recomputation(model: nn.Module, params: Params, prompt: jax.Array, n: int,
                            prompt_segment_ids: jax.Array | None = None,
                            bidirectional_prompt: bool = False) -> jax.Array:
  """Reference greedy decoding without a cache: the full model on the whole sequence each step.

  The sequence buffer has the final length p + n - 1, with not-yet-generated slots marked as
  padding (segment 0); causal attention makes them invisible to the positions read.

  Args:
    model, params: as for `generate`.
    prompt: [b, p] int32, left-padded.
    n: tokens to generate.
    prompt_segment_ids: [b, p], 0 on left padding (default: all 1).
    bidirectional_prompt: the prompt's tokens see each other (`ops.prefix_lm_mask`).
  Returns:
    [b, n] int32.
  """
  b, p = prompt.shape
  check_fits(model, p, n)
  seg = jnp.ones_like(prompt) if prompt_segment_ids is None else prompt_segment_ids
  total = p + n - 1
  tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)
  segments = jnp.zeros((b, total), jnp.int32).at[:, :p].set(seg)
  prefix = jnp.sum(seg > 0, axis=1, keepdims=True) if bidirectional_prompt else 0  # [b, 1] real prompt tokens

  def forward(t, s):
    positions = prompt_positions(s)
    return model.apply({"params": params}, t, s, positions, mask=ops.prefix_lm_mask(s, positions, prefix))

  forward = jax.jit(forward)
  out = []
  for k in range(n):
    logits = forward(tokens, segments)  # [b, total, v]
    new = jnp.argmax(logits[:, p - 1 + k], axis=-1).astype(jnp.int32)  # [b]
    out.append(new)
    if p + k < total:
      tokens = tokens.at[:, p + k].set(new)
      segments = segments.at[:, p + k].set(1)
  return jnp.stack(out, axis=1)


# ============================================================================ encoder-decoder


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "start_id", "eos_id", "pad_id"))
def generate_seq2seq(model: nn.Module, params: Params, encoder_tokens: jax.Array, encoder_segment_ids: jax.Array,
                     rng: jax.Array, *, max_new_tokens: int, start_id: int, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None,
                     pad_id: int | None = None) -> jax.Array:
  """Encoder-decoder generation: encode once, then decode with the self-attention KV cache.

  Args:
    model: an encoder_decoder family module.
    params: its parameters.
    encoder_tokens, encoder_segment_ids: [b, s] int32 (segment 0 = padding, anywhere).
    rng: PRNG key (unused when greedy).
    max_new_tokens: decoder tokens to generate, at most `model.cfg.max_length`.
    start_id: the decoder's first input (T5: pad = 0, as in training's shift-right).
    temperature, top_k, top_p, eos_id, pad_id: as for `generate`.
  Returns:
    [b, max_new_tokens] int32.
  """
  b = encoder_tokens.shape[0]
  check_fits(model, 1, max_new_tokens)
  pad_id = eos_id if pad_id is None else pad_id
  encoder_positions = prompt_positions(encoder_segment_ids)
  encoded = model.apply({"params": params}, encoder_tokens, encoder_segment_ids, encoder_positions)  # [b, s, e]
  ones = jnp.ones((b, 1), jnp.int32)

  def body(carry, i):
    cache, token, finished = carry
    logits, variables = model.apply(
        {"params": params, "cache": cache}, None, encoder_segment_ids, None, token[:, None], ones, ones * i,
        decode=True, encoded=encoded, mutable=["cache"])
    new = sample_next(logits[:, -1], jax.random.fold_in(rng, i), temperature=temperature, top_k=top_k, top_p=top_p)
    if eos_id is not None:
      new = jnp.where(finished, pad_id, new)
      finished = finished | (new == eos_id)
    return (variables["cache"], new, finished), new

  carry = (init_cache(model, b), jnp.full((b,), start_id, jnp.int32), jnp.zeros((b,), bool))
  _, outputs = jax.lax.scan(body, carry, jnp.arange(max_new_tokens))  # [n, b]
  return outputs.T


def greedy_seq2seq_by_recomputation(model: nn.Module, params: Params, encoder_tokens: jax.Array,
                                    encoder_segment_ids: jax.Array, n: int, *, start_id: int) -> jax.Array:
  """Reference: greedy decoding running the whole model (no cache) at every step. [b, n] int32."""
  b = encoder_tokens.shape[0]
  enc_pos = prompt_positions(encoder_segment_ids)
  forward = jax.jit(lambda d, ds: model.apply({"params": params}, encoder_tokens, encoder_segment_ids, enc_pos, d, ds,
                                              prompt_positions(ds)))
  dec = jnp.zeros((b, n), jnp.int32).at[:, 0].set(start_id)
  seg = jnp.zeros((b, n), jnp.int32).at[:, 0].set(1)
  out = []
  for k in range(n):
    new = jnp.argmax(forward(dec, seg)[:, k], axis=-1).astype(jnp.int32)
    out.append(new)
    if k + 1 < n:
      dec, seg = dec.at[:, k + 1].set(new), seg.at[:, k + 1].set(1)
  return jnp.stack(out, axis=1)


def left_pad(rows: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads int rows to one length: (tokens [b, p], segment_ids [b, p], 0 on padding)."""
  p = max(len(r) for r in rows)
  tokens = np.full((len(rows), p), pad_id, np.int32)
  segments = np.zeros((len(rows), p), np.int32)
  for i, r in enumerate(rows):
    if len(r):
      tokens[i, p - len(r):] = r
      segments[i, p - len(r):] = 1
  return tokens, segments


def cut_at_eos(ids: np.ndarray, eos_id: int | None) -> list[int]:
  """The generated ids up to (not including) the first EOS."""
  ids = [int(i) for i in ids]
  return ids[:ids.index(eos_id)] if eos_id is not None and eos_id in ids else ids


# ============================================================================ command line


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m tfx.generate", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a tfx run directory (config.json + checkpoints)")
  parser.add_argument("--prompt", required=True, help="text to continue")
  parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's generate.max_new_tokens")
  parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
  parser.add_argument("--top-k", type=int, default=None, help="0 = off")
  parser.add_argument("--top-p", type=float, default=None, help="1.0 = off")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--num-samples", type=int, default=1, help="continuations of the same prompt")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  args = parser.parse_args(argv)
  try:
    texts = run(args)
  except UserError as e:
    sys.exit(f"tfx.generate: {e}")
  for i, text in enumerate(texts):
    if len(texts) > 1:
      print(f"--- sample {i + 1}/{len(texts)} ---")
    print(text)


def run(args: argparse.Namespace) -> list[str]:
  """Loads the run, encodes `[BOS] + prompt`, generates; returns the decoded continuations."""
  from tfx.train import load_trained

  config, tokenizer, model, params = load_trained(args.workdir, step=args.step)
  if config.model.family not in ("decoder", "encoder_decoder"):
    raise UserError(f"tfx.generate samples from decoder and encoder_decoder models; this run is a "
                    f"{config.model.family!r} model")
  g = config.generate
  pick = lambda value, default: default if value is None else value
  max_new = pick(args.max_new_tokens, g.max_new_tokens)
  temperature = pick(args.temperature, g.temperature)
  top_k, top_p = pick(args.top_k, g.top_k), pick(args.top_p, g.top_p)
  if not (math.isfinite(temperature) and temperature >= 0) or top_k < 0 or not 0.0 < top_p <= 1.0:
    raise UserError(f"need a finite --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1 (got {temperature}, "
                    f"{top_k}, {top_p})")
  if args.num_samples < 1:
    raise UserError("--num-samples must be at least 1")
  if config.model.family == "encoder_decoder":
    # The prompt goes to the encoder (ending with EOS, as span-corruption inputs do); the
    # decoder starts from pad, as training's shift-right does.
    ids = np.append(tokenizer.encode([args.prompt])[0], tokenizer.eos_id).astype(np.int32)
    ids = ids[-model.cfg.max_length:]
    enc = np.tile(ids, (args.num_samples, 1))
    out = generate_seq2seq(model, params, jnp.asarray(enc), jnp.ones_like(jnp.asarray(enc)), jax.random.key(args.seed),
                           max_new_tokens=min(max_new, model.cfg.max_length), start_id=tokenizer.pad_id or 0,
                           temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                           eos_id=tokenizer.eos_id)
    return [tokenizer.decode(cut_at_eos(row, tokenizer.eos_id)) for row in np.asarray(jax.device_get(out))]
  bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id  # as tfx.objectives.causal_lm
  ids = np.concatenate([[bos], tokenizer.encode([args.prompt])[0]]).astype(np.int32)
  if args.max_new_tokens is None and len(ids) <= model.cfg.max_length:
    max_new = min(max_new, model.cfg.max_length - len(ids) + 1)  # the run's default, clipped to what fits
  prompt, segments = left_pad([ids] * args.num_samples, tokenizer.pad_id or 0)
  bidirectional = OBJECTIVES.get(config.objective.name).bidirectional_prompt(config.objective)
  out = generate(model, params, jnp.asarray(prompt), jnp.asarray(segments), jax.random.key(args.seed),
                 max_new_tokens=max_new, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                 eos_id=tokenizer.eos_id, bidirectional_prompt=bidirectional)
  return [tokenizer.decode(cut_at_eos(row, tokenizer.eos_id)) for row in np.asarray(jax.device_get(out))]


if __name__ == "__main__":
  main()
