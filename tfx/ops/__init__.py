"""Pure functions with no parameters: attention and masks, positions, losses."""

from tfx.ops.attention import (
    MASK_VALUE,
    SegmentMask,
    assert_rows_attend,
    causal_mask,
    decoder_mask,
    dense_mask,
    dot_product_attention,
    log_choice,
    padding_mask,
    prefix_lm_mask,
    recorded_choices,
    reference_attention,
    rows_attend,
    segment_mask,
    self_attention_mask,
)
from tfx.ops.losses import HeadWeights, TokenTargets, linear_cross_entropy, weighted_cross_entropy
from tfx.ops.norms import layer_norm, rms_norm
from tfx.ops.positions import rotary, sinusoidal, t5_relative_buckets
