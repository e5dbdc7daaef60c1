from pallas_kernels.linear_attention.api import (
    apply_summary,
    compose_summaries,
    decode_layer_uses_kernel,
    kda,
    kda_decode_layer,
    kda_decode_step,
    kda_decode_steps,
    kda_state_summary,
    kda_verify_layer,
)
from pallas_kernels.linear_attention.context_parallel import (
    gather_in_sequence_order,
    kda_sequence_parallel,
    split_pieces,
)
from pallas_kernels.linear_attention.reference import gated_rms_norm, kda_gate, short_conv

__all__ = [
    "apply_summary",
    "compose_summaries",
    "decode_layer_uses_kernel",
    "gated_rms_norm",
    "gather_in_sequence_order",
    "kda",
    "kda_decode_layer",
    "kda_decode_step",
    "kda_decode_steps",
    "kda_gate",
    "kda_sequence_parallel",
    "kda_state_summary",
    "kda_verify_layer",
    "short_conv",
    "split_pieces",
]
