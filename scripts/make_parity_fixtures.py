"""Build the tiny transformers parity fixtures under tests/fixtures/ (not a CI dependency).

Needs CPU torch and transformers 5.23 (a separate Python 3.11 venv is fine):
    python -m venv /tmp/oracle && /tmp/oracle/bin/pip install torch==2.13.0 transformers==5.23.0
    /tmp/oracle/bin/python scripts/make_parity_fixtures.py

For each of `kimi_linear` and `deepseek_v32` it writes `tests/fixtures/<name>/`: the checkpoint as
`save_pretrained` writes it (config.json + model.safetensors, float32), and `reference.npz` with the input
ids, the float32 logits of a full forward pass (eager attention) and 16 greedily generated tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, KimiLinearConfig, KimiLinearForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SEQ = 77  # longer than the KDA chunk (64) and not a multiple of it
NEW_TOKENS = 16


def kimi_linear() -> KimiLinearForCausalLM:
    cfg = KimiLinearConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        pad_token_id=159,
        bos_token_id=157,
        eos_token_id=158,
        tie_word_embeddings=False,
        linear_attn_config={
            "kda_layers": [1, 2, 4, 5],
            "full_attn_layers": [3],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        first_k_dense_replace=1,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return KimiLinearForCausalLM(cfg)


def deepseek_v32() -> DeepseekV32ForCausalLM:
    cfg = DeepseekV32Config(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        # 16 indexer heads: with 4, a key whose q.k is negative in every head scores exactly 0 often enough
        # that ties at the Top-K boundary appear, and torch.topk breaks ties in no documented order.
        index_topk=12,
        index_head_dim=16,
        index_n_heads=16,
        first_k_dense_replace=1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        attn_implementation="eager",
    )
    return DeepseekV32ForCausalLM(cfg)


def perturb_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random init leaves norms at 1, biases at 0 and A_log/dt_bias at fixed values; randomise every
    tensor a little so that a wrong mapping of any one of them shows up in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("bias", "A_log", "dt_bias")):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def build(name: str, make) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = make().float().eval()
    perturb_(model, gen)
    ids = torch.randint(3, 150, (2, SEQ), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id
        )
    gen_tokens = out[:, SEQ:].numpy()
    d = OUT / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    np.savez_compressed(
        d / "reference.npz",
        input_ids=ids.numpy().astype(np.int32),
        logits=logits,
        generated=gen_tokens.astype(np.int32),
    )
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "seq": SEQ, "new_tokens": NEW_TOKENS}
    (d / "fixture_versions.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{name}: {size / 1e6:.2f} MB, logits {logits.shape}, generated {gen_tokens.tolist()}")


if __name__ == "__main__":
    build("kimi_linear", kimi_linear)
    build("deepseek_v32", deepseek_v32)
