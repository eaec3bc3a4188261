"""KV-cache decoding: exact agreement with recomputation, one compiled step, sampling filters."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfx import generate as G
from tfx import ops
from tfx.config import load_config
from tfx.errors import UserError
from tfx.models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 100
MAX_LENGTH = 24
BOS = 3
# Two prompts of different lengths, [BOS] + tokens: one batch through left padding.
PROMPTS = [np.array([BOS, 10, 11, 12, 13, 14, 15]), np.array([BOS, 50, 51])]


def make_model(*overrides: str, max_length: int = MAX_LENGTH):
  """A random 2-layer decoder, d_model 64, with weights of std 0.2 so that argmax has no near-ties.

  The parameter shapes come from `model.init` (traced only); the values are drawn with numpy,
  which costs no compilation (as the model's own init: biases 0, norm scales 1).
  """
  cfg = load_config(os.path.join(ROOT, "configs", "base.py"), [
      "--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.d_ff=128", *overrides])
  model = build_model(cfg.model, vocab_size=VOCAB, max_length=max_length)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), **type(model).init_inputs(1, max_length))))
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    if name.endswith("['bias']") or name.endswith("['scale']"):
      return jnp.full(leaf.shape, float(name.endswith("['scale']")), leaf.dtype)
    return jnp.asarray(0.2 * rng.standard_normal(leaf.shape), leaf.dtype)

  return model, jax.tree_util.tree_map_with_path(draw, shapes["params"])


@pytest.fixture(scope="module")
def learned():
  return make_model("--config.model.position=learned")


def batch():
  prompt, segments = G.left_pad(PROMPTS, pad_id=0)
  return jnp.asarray(prompt), jnp.asarray(segments)


@pytest.mark.parametrize("position", ["learned", "rotary"])
@pytest.mark.parametrize("scan_layers", ["true", "false"])
def test_cached_greedy_equals_recomputation(position, scan_layers):
  model, params = make_model(f"--config.model.position={position}", f"--config.model.scan_layers={scan_layers}")
  prompt, segments = batch()
  n = MAX_LENGTH - prompt.shape[1] + 1  # fills the cache exactly
  cached = G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=n)
  reference = G.greedy_by_recomputation(model, params, prompt, n, segments)
  assert cached.shape == (2, n) and cached.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(reference))
  assert len(np.unique(np.asarray(cached))) > 2  # not a degenerate constant output


def test_prefix_lm_prompt_is_bidirectional(learned):
  """A prefix-LM decoder saw `[BOS] + prefix` bidirectionally in training: its cached generation
  equals recomputation under `ops.prefix_lm_mask`, and the prompt's first prediction is that of a
  full forward pass with the prompt as prefix (it differs from the causal one)."""
  model, params = learned
  prompt, segments = batch()
  n = 6
  cached = G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=n, bidirectional_prompt=True)
  full = G.greedy_by_recomputation(model, params, prompt, n, segments, bidirectional_prompt=True)
  np.testing.assert_array_equal(np.asarray(cached), np.asarray(full))
  positions = G.prompt_positions(segments)
  prefix = jnp.sum(segments, axis=1, keepdims=True)
  logits = model.apply({"params": params}, prompt, segments, positions,
                       mask=ops.prefix_lm_mask(segments, positions, prefix))[:, -1]  # [b, v]
  mask = G.prompt_mask(segments, model.cfg.max_length)
  first, _ = G.decode_step(model, params, G.init_cache(model, prompt.shape[0]), prompt, positions, segments, mask)
  np.testing.assert_allclose(np.asarray(first), np.asarray(logits), atol=1e-4)
  causal, _ = G.decode_step(model, params, G.init_cache(model, prompt.shape[0]), prompt, positions, segments)
  assert np.max(np.abs(np.asarray(causal) - np.asarray(logits))) > 1e-2


def test_generate_reads_the_objective_s_prompt_attention():
  from tfx.objectives import prefix_lm, ul2
  from tfx.objectives.causal_lm import CausalLM

  assert prefix_lm.PrefixLM.bidirectional_prompt({}) and not CausalLM.bidirectional_prompt({})
  assert ul2.UL2.bidirectional_prompt({"layout": "decoder"}) and not ul2.UL2.bidirectional_prompt({})


def test_left_padding_does_not_change_a_row(learned):
  model, params = learned
  prompt, segments = batch()
  together = G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=8)
  alone = G.generate(model, params, jnp.asarray(PROMPTS[1][None]), jnp.ones((1, len(PROMPTS[1])), jnp.int32),
                     jax.random.key(0), max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(together[1]), np.asarray(alone[0]))


def test_decode_step_is_traced_once(learned, monkeypatch):
  model, params = learned
  traces = []
  original = G.decode_step

  def counting_step(*args, **kwargs):
    traces.append(1)  # runs only while tracing
    return original(*args, **kwargs)

  monkeypatch.setattr(G, "decode_step", counting_step)
  prompt, segments = G.left_pad([np.array([BOS, 7, 8, 9]), np.array([BOS, 20]), np.array([BOS])], pad_id=0)
  out1 = G.generate(model, params, jnp.asarray(prompt), jnp.asarray(segments), jax.random.key(0), max_new_tokens=13)
  assert len(traces) == 2  # the prompt's one call, and one trace of the step that feeds the 12 new tokens
  out2 = G.generate(model, params, jnp.asarray(prompt + 1), jnp.asarray(segments), jax.random.key(1),
                    max_new_tokens=13)
  jax.block_until_ready((out1, out2))
  assert len(traces) == 2


def test_top_k_one_sampling_equals_greedy(learned):
  model, params = learned
  prompt, segments = batch()
  greedy = G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=10)
  sampled = G.generate(model, params, prompt, segments, jax.random.key(5), max_new_tokens=10,
                       temperature=1.5, top_k=1)
  np.testing.assert_array_equal(np.asarray(sampled), np.asarray(greedy))


def test_sampling_is_reproducible_per_seed(learned):
  model, params = learned
  prompt, segments = batch()
  sample = lambda seed: np.asarray(G.generate(model, params, prompt, segments, jax.random.key(seed),
                                              max_new_tokens=16, temperature=2.0, top_p=0.95))
  np.testing.assert_array_equal(sample(1), sample(1))
  assert not np.array_equal(sample(1), sample(2))


def test_eos_finishes_a_row(learned):
  model, params = learned
  prompt, segments = batch()
  greedy = np.asarray(G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=10))
  eos, pad = int(greedy[0, 3]), VOCAB - 1
  out = np.asarray(G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=10,
                              eos_id=eos, pad_id=pad))
  for row, expected in zip(out, greedy):
    hits = np.flatnonzero(expected == eos)
    stop = hits[0] + 1 if len(hits) else len(expected)
    np.testing.assert_array_equal(row[:stop], expected[:stop])
    assert (row[stop:] == pad).all()
  assert G.cut_at_eos(out[0], eos) == list(greedy[0, :list(greedy[0]).index(eos)])


def test_prompt_too_long_is_a_clear_error(learned):
  model, params = learned
  prompt = jnp.full((1, MAX_LENGTH - 3), 5, jnp.int32)
  segments = jnp.ones_like(prompt)
  with pytest.raises(UserError, match="does not fit.*at most 4 new tokens"):
    G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=5)
  with pytest.raises(UserError, match="does not fit"):
    G.greedy_by_recomputation(model, params, prompt, 5)
  assert G.generate(model, params, prompt, segments, jax.random.key(0), max_new_tokens=4).shape == (1, 4)


# ----------------------------------------------------------------------------- filters

PROBS = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
PERM = np.array([3, 0, 4, 1, 2])  # vocab slot i holds PROBS[PERM[i]]: the most likely is slot 1


def kept(filtered: jax.Array) -> set[int]:
  return set(np.flatnonzero(np.isfinite(np.asarray(filtered[0]))).tolist())


@pytest.mark.parametrize("p, ranks", [(0.3, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (0.9, {0, 1, 2, 3}),
                                      (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_p(p, ranks):
  logits = jnp.log(jnp.asarray(PROBS[PERM]))[None]  # [1, 5]
  slots = {int(np.flatnonzero(PERM == r)[0]) for r in ranks}
  assert kept(G.top_p_filter(logits, p)) == slots


def test_top_k_keeps_the_k_largest():
  logits = jnp.log(jnp.asarray(PROBS[PERM]))[None]
  assert kept(G.top_k_filter(logits, 2)) == {1, 3}
  assert kept(G.top_k_filter(logits, 0)) == set(range(5))


def test_samples_stay_in_the_filtered_set():
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS[PERM])), (2000, 5))
  draws = np.asarray(G.sample_next(logits, jax.random.key(0), temperature=1.0, top_p=0.6))
  assert set(draws.tolist()) == {1, 3}
  # Renormalised over the kept set: 0.5 / 0.7 and 0.2 / 0.7.
  assert abs(np.mean(draws == 1) - 5 / 7) < 0.05
  greedy = np.asarray(G.sample_next(logits[:1], jax.random.key(0)))
  assert greedy.tolist() == [1]


def test_prompt_positions_count_from_the_first_real_token():
  segments = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(np.asarray(G.prompt_positions(segments)), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_cli_reports_a_user_error(tmp_path):
  with pytest.raises(SystemExit, match="tfx.generate: .* is not a tfx run"):
    G.main(["--workdir", str(tmp_path), "--prompt", "hello"])


def test_left_pad_and_cut_at_eos():
  tokens, segments = G.left_pad([np.array([3, 7, 8]), np.array([3])], pad_id=0)
  np.testing.assert_array_equal(tokens, [[3, 7, 8], [0, 0, 3]])
  np.testing.assert_array_equal(segments, [[1, 1, 1], [0, 0, 1]])
  assert G.cut_at_eos(np.array([5, 6, 1, 1]), eos_id=1) == [5, 6]
  assert G.cut_at_eos(np.array([5, 6]), eos_id=1) == [5, 6]
