"""The transformers side of `benchmarks/e2e.py`, run in its own process (PyTorch and JAX do not share a GPU's
memory well, and this file must not import JAX).

    python -m benchmarks.e2e_transformers make OUT [--arch kimi|glm5|qwen3_next] [--layers 8 --experts 32 --vocab V]
        A model with random weights at a released model's widths (fewer layers and experts so it fits one
        GPU), saved with `save_pretrained` in bfloat16, plus `e2e_reference.npz`: a 64-token prompt and the
        logits of its last token computed in float32 from the saved bf16 weights, for the parity check on the
        JAX side. `kimi`: a Kimi-Linear-48B-shaped
        `KimiLinearForCausalLM`; `glm5`: a GLM-5.3-Flash-shaped `Glm5NextForConditionalGeneration` (the text
        part at full width, a one-block vision tower that no benchmark feeds); `qwen3_next`: a
        Qwen3-Next-80B-A3B-shaped `Qwen3NextForCausalLM`.
    python -m benchmarks.e2e_transformers bench OUT --ttft 4096 32768 --batches 1 16 64 --context 2048
        Time to first token (prefill + the first token's logits, batch 1), the decode step at each batch
        after `context` cached tokens, peak memory. One `RESULT {json}` line per measurement on stdout. The
        model class comes from the folder's `model_type`.

flash-linear-attention: transformers uses fla's `chunk_kda` / `fused_recurrent_kda` (Qwen3-Next:
`chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule`) when the `fla` package imports (carry the
fla-core and einops wheels to the GPU machine); the result lines say whether it did.
`glm5_next` needs transformers >= 5.23 (carry its wheel where the image has an older one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = 64


def kimi_config(layers: int, experts: int, vocab: int, tiny: bool = False):
    """Kimi-Linear-48B-A3B widths (hidden 2304, 32 KDA heads x 128, MLA 32 heads, latent 512 + NoPE, 8 of
    `experts` routed + 1 shared of width 1024); MLA every fourth layer and the last, as in the 48B model.
    tiny=True divides every width by 16 (CPU smoke tests of this script)."""
    from transformers import KimiLinearConfig

    d = 16 if tiny else 1
    full = sorted({i for i in range(4, layers + 1, 4)} | {layers})  # 1-based
    return KimiLinearConfig(
        vocab_size=vocab,
        hidden_size=2304 // d,
        intermediate_size=9216 // d,
        moe_intermediate_size=1024 // d,
        num_hidden_layers=layers,
        num_attention_heads=32 // d,
        num_key_value_heads=32 // d,
        kv_lora_rank=512 // d,
        q_lora_rank=None,
        qk_rope_head_dim=64 // d,
        qk_nope_head_dim=128 // d,
        v_head_dim=128 // d,
        num_local_experts=experts,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        bos_token_id=vocab - 4,
        eos_token_id=vocab - 3,
        pad_token_id=vocab - 1,
        tie_word_embeddings=False,
        linear_attn_config={
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "full_attn_layers": full,
            "num_heads": 32 // d,
            "head_dim": 128 // d,
            "short_conv_kernel_size": 4,
        },
        first_k_dense_replace=1,
        max_position_embeddings=262144,
    )


def glm5_config(layers: int, experts: int, vocab: int, tiny: bool = False):
    """GLM-5.3-Flash widths (transformers 5.23's `Glm5NextTextConfig` defaults: hidden 4096, 64 KDA heads x 128,
    NoPE DSA MLA 64 heads with latent 512, KPool indexer 32 heads x 128 over pools of 16, top-2048, 4
    hyper-connection streams, clamped SwiGLU, 8 of `experts` routed + 1 shared of width 2048); DSA every
    fourth layer (transformers' default rule), the first three FFNs dense, as released. tiny=True divides
    every width by 16 (CPU smoke tests of this script)."""
    from transformers import Glm5NextConfig

    d = 16 if tiny else 1
    text = dict(
        vocab_size=vocab,
        hidden_size=4096 // d,
        intermediate_size=12288 // d,
        moe_intermediate_size=2048 // d,
        num_hidden_layers=layers,
        num_attention_heads=64 // d,
        num_key_value_heads=64 // d,
        q_lora_rank=1536 // d,
        kv_lora_rank=512 // d,
        qk_nope_head_dim=256 // d,
        v_head_dim=256 // d,
        qk_rope_head_dim=0,
        index_n_heads=32 // d,
        index_head_dim=128 // d,
        index_topk=2048 // d,
        index_kpool=16,
        linear_num_heads=64 // d,
        linear_head_dim=128 // d,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        mlp_layer_types=["dense"] * min(3, layers) + ["sparse"] * max(0, layers - 3),
        indexer_types=["full"] * layers,
        pad_token_id=vocab - 1,
        bos_token_id=vocab - 4,
        eos_token_id=vocab - 3,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=4096 // d, intermediate_size=32,
                  projection_intermediate_size=32, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=2)  # fmt: skip
    return Glm5NextConfig(text_config=text, vision_config=vision)


def qwen3_next_config(layers: int, experts: int, vocab: int, tiny: bool = False):
    """Qwen3-Next-80B-A3B widths (hidden 2048; Gated DeltaNet 16 key / 32 value heads x 128; gated GQA 16 query /
    2 kv heads x 256, RoPE on 64 dims, theta 1e7; 10 of `experts` routed + a gated shared expert, width 512);
    full attention every fourth layer, every FFN MoE, as released. tiny=True divides every width by 16."""
    from transformers import Qwen3NextConfig

    d = 16 if tiny else 1
    h = 4 if tiny else 1  # head counts: 16 / 4 query, 2 kv, 16 / 4 key, 32 / 4 value heads when tiny
    return Qwen3NextConfig(
        vocab_size=vocab, hidden_size=2048 // d, intermediate_size=5120 // d, num_hidden_layers=layers,
        num_attention_heads=16 // h, num_key_value_heads=2, head_dim=256 // d,
        linear_num_key_heads=16 // h, linear_num_value_heads=32 // h,
        linear_key_head_dim=128 // d, linear_value_head_dim=128 // d, moe_intermediate_size=512 // d,
        shared_expert_intermediate_size=512 // d, num_experts=experts, num_experts_per_tok=min(10, experts),
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        pad_token_id=vocab - 1, bos_token_id=vocab - 4, eos_token_id=vocab - 3,
    )  # fmt: skip


ARCHS = {
    "kimi": (kimi_config, "KimiLinearForCausalLM"),
    "glm5": (glm5_config, "Glm5NextForConditionalGeneration"),
    "qwen3_next": (qwen3_next_config, "Qwen3NextForCausalLM"),
}
VOCAB = {"kimi": 163840, "glm5": 154880, "qwen3_next": 151936}  # the released vocabularies
MODEL_TYPES = {
    "kimi_linear": "KimiLinearForCausalLM",
    "glm5_next": "Glm5NextForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}


def _model_class(name: str):
    import transformers

    return getattr(transformers, name)


def make(
    out: Path, layers: int, experts: int, vocab: int | None, device: str, tiny: bool = False, arch: str = "kimi"
) -> None:
    config_fn, cls = ARCHS[arch]
    vocab = vocab or VOCAB[arch]
    torch.manual_seed(0)
    cfg = config_fn(layers, experts, vocab, tiny)
    with torch.device(device):
        model = _model_class(cls)(cfg).eval()
    # The reference logits in float32 from the weights as saved (rounded to bfloat16): the parity row then
    # measures the bf16 engine's own error, not the sum of two engines' bf16 rounding.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.randint(0, vocab - 8, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids.to(device)).logits[0, -1].float().cpu().numpy()
    model = model.to(torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    np.savez(tmp / "e2e_reference.npz", ids=ids.numpy(), logits=logits, dtype="float32")
    tmp.rename(out)  # a half-written folder never carries the final name
    n = sum(p.numel() for name, p in model.named_parameters() if ".visual." not in f".{name}")
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, layers {cfg.get_text_config().layer_types}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_ms(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def bench(folder: Path, ttft: list[int], batches: list[int], context: int, device: str, iters: int) -> None:
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    if model_type not in MODEL_TYPES:
        raise SystemExit(f"bench: model_type {model_type!r} in {folder}: expected one of {sorted(MODEL_TYPES)}")
    fla = "fla" in sys.modules or _fla_importable()
    model = _model_class(MODEL_TYPES[model_type]).from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    fla = fla and "fla" in sys.modules  # the model module imports fla when it uses it
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)

    def emit(**kw):
        kw.update(engine="transformers", fla=fla, device=torch.cuda.get_device_name() if device == "cuda" else device)
        print("RESULT " + json.dumps(kw), flush=True)

    with torch.no_grad():
        for t in ttft:
            ids = torch.randint(0, vocab - 8, (1, t), generator=gen).to(device)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()

            def first_token(ids=ids):
                out = model(ids, use_cache=True, logits_to_keep=1)
                return out.logits[:, -1].argmax(-1)

            try:
                ms = _median_ms(first_token, device, warmup=1, iters=iters)
                emit(case="ttft", batch=1, tokens=t, ms=ms, peak_gib=_peak_gib(device))
            except torch.OutOfMemoryError as e:
                emit(case="ttft", batch=1, tokens=t, error=f"out of memory: {str(e)[:120]}")
                torch.cuda.empty_cache()
        for b in batches:
            ids = torch.randint(0, vocab - 8, (b, context), generator=gen).to(device)
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            try:
                out = model(ids, use_cache=True, logits_to_keep=1)
                cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                times = []
                for i in range(2 + max(iters, 10)):  # each step grows the cache by one token, as in generate
                    _sync(device)
                    t0 = time.perf_counter()
                    out = model(tok, past_key_values=cache, use_cache=True)
                    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    _sync(device)
                    if i >= 2:
                        times.append((time.perf_counter() - t0) * 1e3)
                emit(case="decode", batch=b, tokens=context, ms=statistics.median(times), peak_gib=_peak_gib(device))
            except torch.OutOfMemoryError as e:
                emit(case="decode", batch=b, tokens=context, error=f"out of memory: {str(e)[:120]}")
            del ids
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


def _fla_importable() -> bool:
    try:
        import fla.ops.kda  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 — any failure means transformers runs its torch fallback
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out", type=Path)
    m.add_argument("--arch", choices=sorted(ARCHS), default="kimi")
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--experts", type=int, default=32)
    m.add_argument("--vocab", type=int, default=None, help="default: the released model's")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m.add_argument("--tiny", action="store_true", help="widths / 16 (CPU smoke tests)")
    b = sub.add_parser("bench")
    b.add_argument("folder", type=Path)
    b.add_argument("--ttft", type=int, nargs="*", default=[4096, 32768])
    b.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    b.add_argument("--context", type=int, default=2048)
    b.add_argument("--iters", type=int, default=3)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.cmd == "make":
        if args.out.exists():
            raise SystemExit(f"{args.out} exists; remove it or choose another folder")
        make(args.out, args.layers, args.experts, args.vocab, args.device, args.tiny, args.arch)
    else:
        bench(args.folder, args.ttft, args.batches, args.context, args.device, args.iters)


if __name__ == "__main__":
    main()
