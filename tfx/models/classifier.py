"""Sequence classification on any family: the family's final hidden states -> ClassifierHead.

The family is a submodule named `backbone`, so the classifier's parameters are
`{"backbone": <the family's own tree>, "head": {"pooler", "classifier"}}`: the backbone part
is a subset of the pretraining parameters (the LM heads, the decoder of an encoder-decoder and
XLNet's mask embedding are not used) and can be copied from a pretrained checkpoint by path.

Pooling, per family (`Family.POOLING`, overridable):
  encoder           'first'  BERT's [CLS] (the row starts with <cls>)
  decoder           'last'   the last real token: causal attention, only it has seen the whole text
  xlnet             'last'   the <cls> that ends an XLNet row
  encoder_decoder   'mean'   the mean of the encoder output over the real tokens (the decoder is
                             not run; T5 itself would generate the label's text instead)

'first' and 'last' read one position: the backbone returns its hidden states there alone
(`Family.sequence_hidden(rows=)`), and the encoder's and decoder's last layer computes nothing else.
"""

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfx.models.base import Family
from tfx.models.encoder import ClassifierHead, pooled_rows

POOLINGS = ("first", "mean", "last")


class Classifier(nn.Module):
  """`backbone` (a registered family) + `ClassifierHead`.

  `__call__(tokens, segment_ids, positions, token_types, *, train) -> logits [b, num_classes]`
  (float32). All inputs [b, t] int32, one right-padded example per row: segment_ids 1 on the
  real tokens, 0 on padding; positions 0..n-1; token_types 0 for the first text, 1 for the
  second (used by families that have token types).

  Attributes:
    backbone: the family module (its parameters live under "backbone").
    num_classes: output classes.
    pooling: 'first', 'mean' or 'last' (see the module docstring).
    dropout: dropout on the pooled vector (training only).
  """

  backbone: Family
  num_classes: int
  pooling: str
  dropout: float = 0.0

  INPUTS: ClassVar[tuple[str, ...]] = ("tokens", "segment_ids", "positions", "token_types")

  @classmethod
  def init_inputs(cls, batch: int, length: int) -> dict[str, jax.Array]:
    """Dummy inputs for `init` (the shape `tfx.train.state_shardings` / `init_state` need)."""
    return {
        "tokens": jnp.zeros((batch, length), jnp.int32),
        "segment_ids": jnp.ones((batch, length), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
        "token_types": jnp.zeros((batch, length), jnp.int32),
    }

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, token_types, *, train: bool = False) -> jax.Array:
    # 'first' / 'last' read one position: the backbone's last layer computes that row alone
    # (its queries, attention output and MLP; keys and values at every position).
    rows = pooled_rows(self.pooling, segment_ids)  # [b, 1], or None ('mean')
    hidden = self.backbone.sequence_hidden(tokens, segment_ids, positions, token_types, train=train,
                                           rows=rows)  # [b, 1, e] or [b, t, e]
    cfg = self.backbone.cfg
    head = ClassifierHead(self.num_classes, pooling=self.pooling, dropout=self.dropout, init_std=cfg.init_std,
                          gathered=rows is not None, name="head")
    return head(hidden, segment_ids, train=train)  # [b, num_classes]

  def last_layer_queries(self) -> int | None:
    """Positions at which the backbone's last layer computes its queries, attention output and MLP:
    1 for a pooled token where the family runs it alone (`Family.rows_alone`), None for all."""
    return 1 if self.pooling != "mean" and self.backbone.rows_alone() else None


def build_classifier(backbone: Family, num_classes: int, *, pooling: str = "auto", dropout: float = 0.0) -> Classifier:
  """A Classifier on `backbone`; pooling 'auto' = the family's default (`Family.POOLING`)."""
  pooling = type(backbone).POOLING if pooling == "auto" else pooling
  if pooling not in POOLINGS:
    raise ValueError(f"unknown pooling {pooling!r}; choose 'auto' or one of {', '.join(POOLINGS)}")
  if num_classes < 2:
    raise ValueError(f"a classifier needs at least 2 classes, got {num_classes}")
  return Classifier(backbone, num_classes, pooling, dropout)
