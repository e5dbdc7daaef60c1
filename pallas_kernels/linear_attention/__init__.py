from pallas_kernels.linear_attention.api import (
    apply_summary,
    compose_summaries,
    kda,
    kda_decode_layer,
    kda_decode_step,
    kda_state_summary,
)

__all__ = ["apply_summary", "compose_summaries", "kda", "kda_decode_layer", "kda_decode_step", "kda_state_summary"]
