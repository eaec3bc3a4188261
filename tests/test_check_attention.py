"""tfx.check_attention: every attention kernel against the float32 reference on the masks the
families build. On this CPU, with a GPU faked for the choice, 'pallas' runs its kernel in Pallas'
interpreter and 'cudnn' falls back to XLA when jax refuses it; the check must also catch a wrong
kernel."""

import json

import jax
import jax.numpy as jnp
import pytest

from tfx import check_attention, ops
from tfx.ops import attention as attn


@pytest.fixture(scope="module")
def cases():
  return check_attention.make_cases(length=32, heads=4, head_dim=16, dtype=jnp.float32)


def test_cases_cover_the_masks_of_every_family(cases):
  """Causal / bidirectional packed rows as segment ids, grouped-query heads, the dense masks
  (prefix LM, both XLNet streams, cross attention), T5's bias beside a packed mask and beside rows'
  lengths, XLNet's terms as a bias per row; the query stream has rows with no key; a packed row and
  rows' lengths at an odd length; packed rows as runs for cuDNN's packed layout, fitting it or not;
  attention dropout on self-attention's segment ids, on a cross attention's ids and on the query
  stream (its dense mask; XLNet's: a bias per row carrying the mask)."""
  names = [c.name for c in cases]
  assert names == ["causal_packed", "causal_padded", "bidirectional_padded", "grouped_query_causal",
                   "causal_packed_runs", "bidirectional_padded_runs", "grouped_query_causal_runs",
                   "causal_packed_runs_overflow", "prefix_lm",
                   "two_stream_content", "two_stream_query", "cross", "biased_packed", "biased_lengths",
                   "biased_causal_lengths", "biased_two_stream", "cross_lengths", "causal_padded_odd",
                   "biased_causal_lengths_odd", "causal_packed_dropout", "bidirectional_padded_dropout",
                   "grouped_query_causal_dropout", "cross_dropout", "two_stream_query_dropout",
                   "biased_two_stream_dropout"]
  assert [c.dropout for c in cases if c.dropout] == [0.1, 0.1, 0.3, 0.1, 0.1, 0.1]
  by_name = {c.name: c for c in cases}
  assert [c.name for c in cases if c.bias is not None] == ["biased_packed", "biased_lengths", "biased_causal_lengths",
                                                           "biased_two_stream", "biased_causal_lengths_odd",
                                                           "biased_two_stream_dropout"]
  odd = by_name["causal_padded_odd"]
  assert odd.q.shape[1] == odd.k.shape[1] == odd.mask.segment_ids.shape[1] == 31 and odd.mask.causal
  assert by_name["biased_causal_lengths_odd"].bias.shape == (1, 4, 31, 31)
  assert by_name["biased_two_stream"].bias.shape == (2, 4, 32, 32)
  slots = by_name["biased_two_stream_dropout"]
  assert slots.bias.shape == (2, 4, 21, 32) and slots.mask.shape == (2, 1, 21, 32) and slots.k.shape[1] == 32
  assert bool(jnp.all(by_name["two_stream_query_dropout"].mask == slots.mask))
  lengths = by_name["biased_causal_lengths"].mask
  assert isinstance(lengths, attn.LengthMask) and lengths.causal and lengths.q_lengths.tolist() == [24, 2]
  assert by_name["cross_lengths"].mask.shape == (32, 16)
  # packed: 3 documents a row, padded: 2 and padding; a layout of 4 runs fits both, one of 2 neither
  assert [bool(by_name[name].mask.runs.fits) for name in ("causal_packed_runs", "bidirectional_padded_runs",
                                                           "causal_packed_runs_overflow")] == [True, True, False]
  assert isinstance(by_name["causal_padded"].mask, attn.SegmentMask) and by_name["causal_padded"].mask.causal
  assert by_name["grouped_query_causal"].k.shape[2] == 2 and by_name["cross"].k.shape[1] == 16
  cross = by_name["cross_dropout"]
  assert isinstance(cross.mask, ops.CrossMask) and cross.k.shape[1] == 16
  assert bool(jnp.all(cross.mask.dense() == by_name["cross"].mask))
  query, content = by_name["two_stream_query"].mask, by_name["two_stream_content"].mask
  assert not bool(jnp.all(attn.rows_attend(query) | (by_name["causal_padded"].mask.segment_ids == 0)[:, None]))
  assert bool(jnp.all(content >= query)) and not bool(jnp.all(content == query))  # the content stream sees itself


def test_every_kernel_matches_the_reference(cases, monkeypatch):
  """With a GPU faked for the choice: the Pallas kernel (interpreted) on the segment-id cases,
  XLA's attention where Pallas or cuDNN cannot run, all within float32 rounding of the reference,
  rows with no allowed key exactly zero; the kernel that ran is reported. The dropout cases run
  the Pallas dropout kernel alone."""
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  results = check_attention.run_checks(cases, ("pallas", "cudnn"))  # 'xla' is what cuDNN falls back to here
  assert all(r["ok"] for r in results), check_attention.format_results(results)
  assert max(max(r[k] for k in check_attention.OUTPUTS if k in r) for r in results) < 1e-4
  assert all(("dbias" in r) == (r["case"].startswith("biased")) for r in results)
  ran = {(r["case"], r["implementation"]): r["kernel"] for r in results}
  assert ran["causal_padded", "pallas"] == "pallas (GPU, segment ids)"
  assert ran["prefix_lm", "pallas"].startswith("xla (Pallas flash attention refused")
  assert ran["cross", "cudnn"].startswith("xla (cuDNN")  # fp32: cuDNN needs bf16 / fp16
  assert ran["causal_packed_dropout", "pallas"] == "pallas (GPU, segment ids; dropout 0.1 drawn in the kernel)"
  assert ("causal_packed_dropout", "cudnn") not in ran
  assert ran["cross_dropout", "pallas"] == "pallas (GPU, segment ids; dropout 0.1 drawn in the kernel)"
  assert ran["biased_two_stream_dropout", "pallas"] == ("pallas (GPU, a bias of every row and head carrying the mask; "
                                                        "dropout 0.1 drawn in the kernel)")
  assert ran["two_stream_query_dropout", "pallas"] == "pallas (GPU, a dense mask; dropout 0.1 drawn in the kernel)"
  json.dumps(results)


def test_a_wrong_kernel_fails_the_check(cases, monkeypatch, capsys, tmp_path):
  """A kernel that ignores the mask fails every masked case; one that lets rows with no allowed
  key take the mean of V fails on those rows; the command prints every case, writes its JSON,
  exits non-zero and names the failures."""
  real = attn.softmax_attention
  monkeypatch.setattr(attn, "softmax_attention", lambda q, k, v, mask, bias, scale, **kw: real(q, k, v, None, bias, scale))
  results = check_attention.run_checks(cases[:2], ("xla",))
  assert not any(r["ok"] for r in results) and all(r["out"] > 0.05 for r in results)

  def leaky(q, k, v, mask, bias, scale, **_):  # the reference softmax: a row with no key averages V
    return attn.reference_attention(q, k, v, mask=mask, bias=bias, scale=scale)

  monkeypatch.setattr(attn, "softmax_attention", leaky)
  (result,) = check_attention.run_checks([c for c in cases if c.name == "two_stream_query"], ("xla",))
  assert not result["ok"] and not result["empty_rows_zero"]
  path = tmp_path / "check.json"
  with pytest.raises(SystemExit, match="failed: .*two_stream_query/xla"):
    check_attention.main(["--dtype", "float32", "--implementations", "xla", "--length", "32", "--head-dim", "16",
                          "--json", str(path)])
  out = capsys.readouterr().out
  assert f"x {jax.devices()[0].device_kind}, float32" in out and "a row with no key is not zero" in out
  written = json.loads(path.read_text())
  assert [r["case"] for r in written] == [c.name for c in cases if not c.dropout]  # those check 'pallas' alone
  by_case = {r["case"]: r for r in written}
  assert [r["ok"] for r in written].count(False) >= 1 and not by_case["two_stream_query"]["empty_rows_zero"]


def test_a_kernel_that_raises_fails_its_case_and_the_others_still_run(cases, monkeypatch):
  # e.g. a kernel XLA cannot compile on the device at hand: the session still gets every other result
  real = attn.dot_product_attention

  def raising(q, k, v, *, mask, **kwargs):  # the runs that fit: the packed kernel's case
    if getattr(mask, "runs", None) is not None and bool(mask.runs.fits):
      raise RuntimeError("cuDNN graph could not be built\nmore detail")
    return real(q, k, v, mask=mask, **kwargs)

  monkeypatch.setattr(check_attention.ops, "dot_product_attention", raising)
  picked = [c for c in cases if c.name in ("causal_packed", "causal_packed_runs", "causal_packed_runs_overflow")]
  results = check_attention.run_checks(picked, ("xla",))
  assert [(r["case"], r["ok"]) for r in results] == [("causal_packed", True), ("causal_packed_runs", False),
                                                     ("causal_packed_runs_overflow", True)]
  failed = results[1]
  assert failed["error"] == "RuntimeError: cuDNN graph could not be built"
  assert "FAIL (RuntimeError: cuDNN graph could not be built)" in check_attention.format_results(results)
  json.dumps(results)


def test_cli_refuses_bad_arguments():
  with pytest.raises(SystemExit, match="unknown --implementations flash"):
    check_attention.main(["--implementations", "flash"])
  with pytest.raises(SystemExit, match="multiple of 16"):
    check_attention.main(["--length", "40"])


def test_a_dropout_kernel_drawing_other_bits_fails(cases, monkeypatch):
  """A dropout kernel whose keep bits differ from what the reference draws (here: each program
  drawing the stream of the row and head after its own) fails every dropout case; without a GPU
  (where no kernel draws those bits) the dropout cases are skipped."""
  from tfx.ops import flash_dropout_kernels as kernels

  dropout = [c for c in cases if c.dropout]
  assert check_attention.run_checks(dropout, ("pallas", "xla")) == []
  monkeypatch.setattr(attn, "_on_gpu", lambda: True)
  stream = kernels.program_stream
  monkeypatch.setattr(kernels, "program_stream", lambda seeds_ref: stream(seeds_ref) + jnp.uint32(1))
  kernels.call.clear_cache()  # the kernels traced before the patch
  try:
    results = check_attention.run_checks(dropout, ("pallas",))
  finally:
    kernels.call.clear_cache()
  assert not any(r["ok"] for r in results) and all(r["out"] > 0.05 for r in results), results
