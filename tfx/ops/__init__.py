"""Pure functions with no parameters: attention and masks, positions, losses."""

from tfx.ops.attention import (
    MASK_VALUE,
    dot_product_attention,
    log_choice,
    recorded_choices,
    reference_attention,
)
from tfx.ops.losses import (HeadWeights, TokenTargets, linear_cross_entropy, soft_cross_entropy, sum_rows,
                             weighted_cross_entropy)
from tfx.ops.masks import (
    CrossMask,
    LengthMask,
    SegmentMask,
    SegmentRuns,
    assert_rows_attend,
    causal_mask,
    decoder_mask,
    dense_mask,
    mask_rows,
    padding_mask,
    prefix_lm_mask,
    rows_attend,
    rows_mask,
    runs_per_row,
    segment_mask,
    segment_runs,
    self_attention_mask,
)
from tfx.ops.norms import layer_norm, rms_norm
from tfx.ops.positions import rotary, sinusoidal, t5_relative_buckets
