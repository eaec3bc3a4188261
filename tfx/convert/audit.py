"""The audit of Hugging Face config fields: every field is mapped, refused, or known not to
change the model's function.

An import reads only the fields it maps; a field that it does not read but that changes the
model (`position_embedding_type="relative_key"`, `scale_attn_by_inverse_layer_idx=True`, pruned
heads) would make the import silently wrong. So each architecture's fields are listed here:

- `MAPPED`: read into the tfx config (the family modules: bert.py, gpt2.py, t5.py, xlnet.py);
- `_Require(test, supported)`: changes the function; tfx supports only the values that pass
  `test` (an absent field means HF's default, which always passes), and refuses the others;
- `_Ignore(reason)`: does not change the logits (generation settings, classification heads,
  storage dtype, ...).

A field in config.json that is in none of these fails the import, naming it: a later
transformers release may add a field that changes the function. `tests/parity` checks this
table against the HF config classes' own field lists, so such a release fails a test too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from tfx.convert.layouts import ConvertError

MAPPED = "mapped"


@dataclasses.dataclass(frozen=True)
class _Require:
  test: Callable[[Any, dict], bool]  # (value, the whole config.json) -> supported
  supported: str  # what tfx supports, for the message


@dataclasses.dataclass(frozen=True)
class _Ignore:
  reason: str


def _equals(value) -> _Require:
  return _Require(lambda v, _: v == value, f"only {value!r}")


def _ignore_all(reason: str, *names: str) -> dict[str, _Ignore]:
  return {n: _Ignore(reason) for n in names}


_NO_HEADS = _Require(lambda v, _: not v, "no pruned heads (every layer has num_heads heads)")

# Fields of every HF config (PretrainedConfig), current and older transformers releases.
GENERIC: dict[str, Any] = {
    "architectures": MAPPED, "model_type": MAPPED, "vocab_size": MAPPED, "tie_word_embeddings": MAPPED,
    "pruned_heads": _NO_HEADS,
    "is_decoder": _equals(False),
    "add_cross_attention": _equals(False),
    "tie_encoder_decoder": _equals(False),
    "cross_attention_hidden_size": _Require(lambda v, _: v is None, "none (no cross-attention into another model)"),
    **_ignore_all("bookkeeping (names, versions, the attention kernel HF picks)", "_name_or_path",
                  "transformers_version", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
                  "attn_implementation", "name_or_path", "model_name"),
    **_ignore_all("what HF's forward returns, not the logits", "output_attentions", "output_hidden_states",
                  "return_dict", "use_return_dict", "torchscript"),
    **_ignore_all("the storage dtype: tfx reads every tensor as float32 (the run's dtype is its own setting)",
                  "dtype", "torch_dtype", "use_bfloat16"),
    **_ignore_all("classification heads and labels, not part of the language model", "id2label", "label2id",
                  "num_labels", "problem_type", "finetuning_task", "classifier_dropout"),
    **_ignore_all("inference cache, memory and loss options of HF's PyTorch code", "use_cache",
                  "gradient_checkpointing", "chunk_size_feed_forward", "tf_legacy_loss"),
    **_ignore_all("initialisation of new weights, not the imported ones", "initializer_range", "initializer_factor"),
    **_ignore_all("is_encoder_decoder follows from the architecture", "is_encoder_decoder"),
    **_ignore_all("special token ids: tokenizer and generation settings (tfx takes them from the tokenizer)",
                  "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
                  "forced_bos_token_id", "forced_eos_token_id", "tokenizer_class", "prefix"),
    **_ignore_all("generation settings, not the model", "max_length", "min_length", "do_sample", "early_stopping",
                  "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
                  "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
                  "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
                  "return_dict_in_generate", "remove_invalid_values", "exponential_decay_length_penalty",
                  "suppress_tokens", "begin_suppress_tokens", "task_specific_params"),
}

_BERT: dict[str, Any] = {
    **{f: MAPPED for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "hidden_act", "layer_norm_eps", "max_position_embeddings", "type_vocab_size",
                           "hidden_dropout_prob", "attention_probs_dropout_prob")},
    "position_embedding_type": _equals("absolute"),
}

_GPT2: dict[str, Any] = {
    **{f: MAPPED for f in ("n_embd", "n_layer", "n_head", "n_inner", "n_positions", "activation_function",
                           "layer_norm_epsilon", "resid_pdrop", "attn_pdrop")},
    "scale_attn_weights": _equals(True),
    "scale_attn_by_inverse_layer_idx": _equals(False),
    "embd_pdrop": _Ignore("dropout on the embeddings (training only; tfx uses resid_pdrop everywhere)"),
    "n_ctx": _Ignore("an old duplicate of n_positions"),
    "reorder_and_upcast_attn": _Ignore("computes attention scores in float32, as tfx's float32 run does anyway"),
    **_ignore_all("the sequence-summary head of GPT2DoubleHeadsModel, not part of the LM", "summary_type",
                  "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout"),
}


def _t5_gated(v, cfg: dict) -> bool:
  return bool(v) == cfg.get("feed_forward_proj", "relu").startswith("gated-")


def _t5_act(v, cfg: dict) -> bool:
  proj = cfg.get("feed_forward_proj", "relu")
  return v == ("gelu_new" if proj == "gated-gelu" else proj.split("-")[-1])  # HF's own special case


_T5: dict[str, Any] = {
    **{f: MAPPED for f in ("d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                           "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
                           "layer_norm_epsilon", "feed_forward_proj", "scale_decoder_outputs")},
    "is_gated_act": _Require(_t5_gated, "the value feed_forward_proj implies (HF derives it from that field)"),
    "dense_act_fn": _Require(_t5_act, "the value feed_forward_proj implies (HF derives it from that field)"),
    "n_positions": _Ignore("unused by T5 (relative positions have no maximum)"),
}

_XLNET: dict[str, Any] = {
    **{f: MAPPED for f in ("d_model", "n_layer", "n_head", "d_head", "d_inner", "ff_activation", "layer_norm_eps",
                           "dropout", "mem_len", "reuse_len", "clamp_len", "bi_data", "untie_r", "attn_type",
                           "same_length")},
    "n_token": MAPPED,  # an old name of vocab_size
    **_ignore_all("whether HF's forward returns memory; tfx's memory length is mem_len", "use_mems_eval",
                  "use_mems_train"),
    **_ignore_all("question-answering and sequence-summary heads, not part of the LM", "start_n_top", "end_n_top",
                  "summary_type", "summary_use_proj", "summary_activation", "summary_last_dropout",
                  "summary_proj_to_labels", "summary_first_dropout"),
}

FIELDS: dict[str, dict[str, Any]] = {
    "BertForMaskedLM": _BERT,
    "RobertaForMaskedLM": {**_BERT, "pad_token_id": MAPPED},  # positions start after the padding row
    "GPT2LMHeadModel": _GPT2,
    "T5ForConditionalGeneration": _T5,
    "XLNetLMHeadModel": _XLNET,
}


def known_fields(arch: str) -> dict[str, Any]:
  """Every audited field of `arch` (generic ones included) -> MAPPED / _Require / _Ignore."""
  return {**GENERIC, **FIELDS[arch]}


def audit(arch: str, hf_cfg: dict, *, path: str = "", trusted: tuple[str, ...] = ()) -> dict[str, str]:
  """{field: MAPPED or the reason it does not matter} for every field of `hf_cfg`.

  Raises ConvertError naming every unsupported value and every field that is not audited
  (unless listed in `trusted`).
  """
  table = known_fields(arch)
  out, refused, unknown = {}, [], []
  for field, value in hf_cfg.items():
    entry = table.get(field)
    if entry is None:
      if field in trusted:
        out[field] = "trusted by the caller (--trust-field)"
      else:
        unknown.append(field)
    elif isinstance(entry, _Require):
      if value is not None and not entry.test(value, hf_cfg):
        refused.append(f"{field}={value!r} (tfx supports {entry.supported})")
      out[field] = MAPPED
    elif isinstance(entry, _Ignore):
      out[field] = entry.reason
    else:
      out[field] = MAPPED
  where = f"{path}/config.json" if path else "config.json"
  if refused:
    raise ConvertError(f"{where}: {arch} with {'; '.join(refused)} is not supported: these fields change the "
                       "model and tfx has no equivalent")
  if unknown:
    flags = " ".join(f"--trust-field {f}" for f in unknown)
    raise ConvertError(f"{where} has field(s) that tfx has not audited for {arch}: {', '.join(unknown)}. They may "
                       f"change the model (a newer transformers?). If they do not, re-run with {flags}, and check the "
                       "result with --verify")
  return out
