"""Flax linen building blocks; every parameter carries logical axis names.

Shape letters (also in tfx/ops/attention.py): b batch, t query length, s key length,
h heads, d head dim, e embed, f MLP hidden, v vocab, l layers.
"""

from tfx.nn.attention import Attention
from tfx.nn.blocks import REMAT_NAMES, Block, QueryStream, Stack
from tfx.nn.layers import GATED, DenseGeneral, Embed, Mlp, ModelConfig, Norm, constrain, make_norm
