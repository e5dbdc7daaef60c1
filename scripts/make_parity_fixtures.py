"""Build the tiny transformers parity fixtures under tests/fixtures/ (not a CI dependency).

Needs CPU torch and transformers 5.23 (a separate Python 3.11 venv is fine):
    python -m venv /tmp/oracle && /tmp/oracle/bin/pip install torch==2.13.0 transformers==5.23.0
    /tmp/oracle/bin/python scripts/make_parity_fixtures.py [--only glm5_next_a glm5_next_b] [--out DIR]

For each of `kimi_linear`, `deepseek_v32`, `glm5_next_a`, `glm5_next_b`, `qwen3_next` and `qwen3_5_moe` it writes
`tests/fixtures/<name>/`:
the checkpoint as `save_pretrained` writes it (config.json + model.safetensors, float32), and `reference.npz`
with the input ids, the float32 logits of a full forward pass (eager attention) and 16 greedily generated tokens.

The glm5_next (GLM-5.3-Flash) and Qwen fixtures are drawn so that no Top-K decision is a near-tie: every DSA
indexer pool selection and every MoE router group/expert selection, in the forward pass and in every generate step,
has its K-th and (K+1)-th score at least MIN_REL_GAP apart (relative to the row's largest |score|), and so has every
greedy argmax. Prompt ids are redrawn id by id until that holds (it is causal); the weights seed is redrawn if it
cannot. Building them takes a few minutes on a few CPU cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.overrides import TorchFunctionMode
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)

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


def build(name: str, make, out_dir: Path = OUT) -> None:
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
    size = write_fixture(out_dir / name, model, ids, logits, gen_tokens, {})
    print(f"{name}: {size / 1e6:.2f} MB, logits {logits.shape}, generated {gen_tokens.tolist()}")


def write_fixture(d: Path, model, ids, logits, gen_tokens, extra_meta: dict) -> int:
    """The folder as tests read it: save_pretrained's files, reference.npz, fixture_versions.json; its bytes."""
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    np.savez_compressed(
        d / "reference.npz",
        input_ids=ids.numpy().astype(np.int32),
        logits=logits,
        generated=gen_tokens.astype(np.int32),
    )
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "seq": SEQ, "new_tokens": NEW_TOKENS}
    (d / "fixture_versions.json").write_text(json.dumps({**meta, **extra_meta}, indent=1) + "\n")
    return sum(f.stat().st_size for f in d.iterdir())


# ---------------------------------------------------------------------------------------------------------------------
# GLM-5.3-Flash (`glm5_next`): KDA + DSA (k-pool indexer, shared indexer layers) + MoE + mHC streams, NoPE.
#
# Sizes: the tests cap everything under tests/fixtures/ at 5 MB, so the expert widths are small and the (unused)
# vision tower uses patch_size 2; every text-side feature is still exercised.

GLM5_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,  # = text hidden_size
    "intermediate_size": 32,
    "projection_intermediate_size": 32,
    "patch_size": 2,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
}

GLM5_TEXT = {
    "glm5_next_a": {
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 6,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
            "indexed_attention",
        ],
        # layer 3 reuses the selection of layer 2 (transformers only hands it to the immediately next layer)
        "indexer_types": ["full", "full", "full", "shared", "full", "full"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "index_kpool": 4,
        "index_topk": 8,
        "index_kpool_always_select_tail": True,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "qk_rope_head_dim": 0,
        "linear_num_heads": 2,
        "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "swiglu_limit": 0.5,
        "rms_norm_eps": 1e-5,
        "pad_token_id": 159,
        "bos_token_id": 157,
        "eos_token_id": 158,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
    "glm5_next_b": {
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 4,
        "num_hidden_layers": 8,  # layer_types by the default rule: layers 3 and 7 are indexed (DSA), the rest KDA
        "indexer_types": ["full"] * 8,
        "mlp_layer_types": ["dense", "dense"] + ["sparse"] * 6,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 7,
        "index_kpool": 8,
        "index_topk": 16,
        "index_kpool_always_select_tail": True,  # False would leave the first queries nothing to read
        "index_n_heads": 8,
        "index_head_dim": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 24,
        "v_head_dim": 16,
        "qk_rope_head_dim": 0,
        "linear_num_heads": 4,
        "linear_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "swiglu_limit": 1.0,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    },
}

MIN_REL_GAP = 1e-3  # Top-K / argmax decisions closer than this (relative) have no single right answer
ID_LOW, ID_HIGH = 3, 150  # prompt ids are drawn from [ID_LOW, ID_HIGH), clear of pad/bos/eos
CANDIDATES = 24  # ids tried per forward pass while drawing a prompt
MAX_SEEDS = 20


class Rejected(Exception):
    """No tie-free draw for this seed."""


def glm5_next(text: dict) -> Glm5NextForConditionalGeneration:
    cfg = Glm5NextConfig(text_config=dict(text), vision_config=dict(GLM5_VISION), attn_implementation="eager")
    return Glm5NextForConditionalGeneration(cfg)


def glm5_randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter and buffer with seeded random values, so that no term is a constant that a wrong
    mapping could hide behind (transformers initialises hc base/scale, the k-pool ape/gate, A_log, norms and the
    routing bias to constants). Matrices get std gain/sqrt(fan_in): gain 0.5 keeps activations O(1) with the
    SwiGLU clamps biting on a fraction of them; the router gets gain 1.5 to spread its sigmoid scores."""

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, p in model.named_parameters():
            module, leaf = name.rsplit(".", 1)
            if leaf == "bias":
                new = 0.1 * randn(p.shape)
            elif "norm" in module.rsplit(".", 1)[-1]:  # RMSNorm / gated RMSNorm / LayerNorm weights
                new = 1.0 + 0.1 * randn(p.shape)
            elif leaf == "base":  # mHC
                new = 0.1 * randn(p.shape)
            elif leaf == "scale":  # mHC
                new = 1.0 + 0.1 * randn(p.shape)
            elif leaf == "index_kpool_compress_ape":
                new = 0.1 * randn(p.shape)
            elif leaf == "index_kpool_compress_gate":
                new = 0.05 * randn(p.shape)
            elif leaf == "A_log":
                new = 0.1 * randn(p.shape)
            elif leaf == "dt_bias":
                new = p + 0.1 * randn(p.shape)
            elif name.endswith("embed_tokens.weight"):
                new = randn(p.shape)
            elif p.dim() >= 2:
                experts = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                fan_in = p.shape[-1] if experts else int(np.prod(p.shape[1:]))
                gain = 1.5 if name.endswith("mlp.gate.weight") else 0.5
                new = gain / fan_in**0.5 * randn(p.shape)
            else:
                raise ValueError(f"no randomisation rule for {name} {tuple(p.shape)}")
            p.copy_(new)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * randn(buf.shape))
            elif not name.endswith("inv_freq"):  # the vision rotary tables are derived, not stored
                raise ValueError(f"no randomisation rule for buffer {name}")


def rel_topk_gap(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `scores` [..., N]: (K-th - (K+1)-th largest valid score) / max |valid score|; +inf where there are
    no more than K valid scores (nothing is decided). Invalid = -inf or the finfo.min fill the indexer uses."""
    if k >= scores.shape[-1]:
        return torch.full((scores.shape[:-1].numel(),), float("inf"), dtype=torch.float64)
    x = scores.detach().double().reshape(-1, scores.shape[-1])
    valid = torch.isfinite(x) & (x > torch.finfo(scores.dtype).min / 2)
    top = x.masked_fill(~valid, float("-inf")).sort(dim=-1, descending=True).values
    gap = top[:, k - 1] - top[:, k]
    scale = x.abs().masked_fill(~valid, 0.0).amax(-1)
    rel = torch.where(scale > 0, gap / scale.clamp_min(1e-300), torch.zeros_like(gap))
    return torch.where(valid.sum(-1) > k, rel, torch.full_like(rel, float("inf")))


class TopkGaps(TorchFunctionMode):
    """While active, records for every Top-K taken by a DSA indexer or an MoE router the relative gap at the
    selection boundary, per (batch row, position): `records` holds (kind, layer, gaps [B, S])."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer, Glm5NextTextTopkRouter

        self.stack: list = []
        self.records: list[tuple[str, int, torch.Tensor]] = []
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, (Glm5NextTextIndexer, Glm5NextTextTopkRouter)):
                layer = int(name.split("layers.")[1].split(".")[0])
                self.handles.append(mod.register_forward_pre_hook(self._enter(mod, layer), with_kwargs=True))
                self.handles.append(mod.register_forward_hook(self._exit))

    def _enter(self, mod, layer):
        def hook(_, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.stack.append((mod, layer, hidden.shape[0], hidden.shape[1]))

        return hook

    def _exit(self, *_) -> None:  # a forward hook must return None, or it replaces the output
        self.stack.pop()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stack and getattr(func, "__name__", None) == "topk":
            mod, layer, b, s = self.stack[-1]
            scores, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
            if hasattr(mod, "index_topk"):
                self.records.append(("indexer", layer, rel_topk_gap(scores, k).view(b, s)))
            elif scores.dim() == 2:  # the within-group top-2 (3-D) only feeds a sum: its ties are harmless
                assert mod.num_group != mod.num_experts
                kind = "group" if scores.shape[-1] == mod.num_group else "expert"
                self.records.append((kind, layer, rel_topk_gap(scores, k).view(b, s)))
        return out

    def min_by_kind(self) -> dict[str, float]:
        res: dict[str, float] = {}
        for kind, _, g in self.records:
            res[kind] = min(res.get(kind, float("inf")), float(g.min()))
        return res

    def min_per_row(self, position: int | None = None) -> torch.Tensor:
        """Min gap per batch row, over every record (or only the given position of full-length records)."""
        rows = None
        for _, _, g in self.records:
            if position is not None:
                if g.shape[1] <= position:
                    continue
                g = g[:, position : position + 1]
            m = g.amin(-1)
            rows = m if rows is None else torch.minimum(rows, m)
        return rows


def argmax_gaps(step_logits) -> torch.Tensor:
    """[B, steps] min(relative, absolute) top-1 - top-2 logit gap of each greedy step."""
    gaps = []
    for lg in step_logits:
        lg = lg.double()
        top2 = lg.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        gaps.append(torch.minimum(gap, gap / lg.abs().amax(-1)))
    return torch.stack(gaps, dim=1)


def glm5_generate(model, ids: torch.Tensor):
    return model.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.text_config.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )


def draw_row(model, gen: torch.Generator, recorder=None, generate=None) -> tuple[torch.Tensor, int]:
    """One prompt row, drawn id by id: every router and indexer Top-K (and every greedy argmax of the continuation)
    must clear MIN_REL_GAP. Everything is causal, so position t only depends on ids <= t and a rejected id is
    simply redrawn. The last id is picked among the valid ones so that the greedy continuation is tie-free too.
    recorder / generate: the Top-K recorder and the greedy generate of the model family (default glm5_next's)."""
    recorder, generate = recorder or TopkGaps, generate or glm5_generate
    row = torch.randint(ID_LOW, ID_HIGH, (SEQ,), generator=gen)
    redraws = 0
    for t in range(SEQ):
        others = torch.randperm(ID_HIGH - ID_LOW, generator=gen) + ID_LOW
        order = torch.cat([row[t : t + 1], others[others != row[t]]])
        passing = []
        for chunk in order.split(CANDIDATES):
            batch = torch.cat([row[:t].expand(len(chunk), t), chunk[:, None]], dim=1)
            with torch.no_grad(), recorder(model) as rec:
                model(batch, use_cache=False)
            ok = chunk[rec.min_per_row(position=t) >= MIN_REL_GAP]
            passing.extend(ok.tolist())
            if passing and t < SEQ - 1:
                break
        if not passing:
            raise Rejected(f"no id at position {t} clears the Top-K gap")
        if t < SEQ - 1:
            redraws += int(passing[0] != int(row[t]))
            row[t] = passing[0]
            continue
        # last position: greedy-decode every valid candidate and keep the first whose continuation is tie-free too
        for chunk in torch.tensor(passing).split(4 * CANDIDATES):
            batch = torch.cat([row[:t].expand(len(chunk), t), chunk[:, None]], dim=1)
            with torch.no_grad(), recorder(model) as rec:
                out = generate(model, batch)
            ok = (rec.min_per_row() >= MIN_REL_GAP) & (argmax_gaps(out.logits).amin(-1) >= MIN_REL_GAP)
            if ok.any():
                pick = int(chunk[ok.nonzero()[0, 0]])
                redraws += int(pick != int(row[t]))
                row[t] = pick
                return row, redraws
    raise Rejected("no last id gives a tie-free greedy continuation")


def clamp_fractions(model, ids: torch.Tensor, limit: float) -> dict[str, tuple[float, float]]:
    """Fraction of gate values > swiglu_limit and of |up| values > swiglu_limit, per MLP kind, in a forward pass."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts, Glm5NextTextMLP

    stats: dict[str, list[int]] = {}

    def add(kind, gate, up):
        st = stats.setdefault(kind, [0, 0, 0])
        st[0] += int((gate > limit).sum())
        st[1] += int((up.abs() > limit).sum())
        st[2] += gate.numel()

    handles, patched = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, Glm5NextTextMLP) and ".language_model." in f".{name}":
            kind = "shared" if name.endswith("shared_experts") else "dense"
            cache = {}
            handles.append(mod.gate_proj.register_forward_hook(lambda m, a, o, c=cache: c.__setitem__("g", o)))
            handles.append(mod.up_proj.register_forward_hook(lambda m, a, o, c=cache, k=kind: add(k, c.pop("g"), o)))
        elif isinstance(mod, Glm5NextTextExperts):
            orig = mod._apply_gate

            def apply_gate(gate_up, orig=orig):
                gate, up = gate_up.chunk(2, dim=-1)
                add("routed", gate, up)
                return orig(gate_up)

            mod._apply_gate = apply_gate
            patched.append(mod)
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    for mod in patched:
        del mod._apply_gate
    return {k: (g / n, u / n) for k, (g, u, n) in stats.items()}


def draw_tie_free(name: str, make, randomize_, seed_base: int, recorder, generate):
    """The first seed whose model (make(), randomised by randomize_(model, generator)) has two prompt rows that
    `draw_row` can draw and whose batched forward and generate clear MIN_REL_GAP at every Top-K and greedy argmax.
    -> (seed, model, ids, logits, generate output, min gaps by kind, per-row redraw counts)."""
    for seed in range(MAX_SEEDS):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed_base + seed)
        model = make().float().eval()
        randomize_(model, gen)
        try:
            rows = [draw_row(model, gen, recorder, generate) for _ in range(2)]
        except Rejected as e:
            print(f"{name}: seed {seed} rejected ({e})")
            continue
        ids = torch.stack([r for r, _ in rows])
        # the fixture's own forward and generate, checked again as they are (batch of 2, with cache)
        with torch.no_grad(), recorder(model) as fwd:
            logits = model(ids).logits.float().numpy()
        with torch.no_grad(), recorder(model) as gen_rec:
            out_gen = generate(model, ids)
        gaps = {f"forward_{k}": v for k, v in fwd.min_by_kind().items()}
        gaps |= {f"generate_{k}": v for k, v in gen_rec.min_by_kind().items()}
        gaps["generate_argmax"] = float(argmax_gaps(out_gen.logits).min())
        gaps = {k: v for k, v in gaps.items() if v < float("inf")}  # n_group 1: no group choice to make
        if min(gaps.values()) < MIN_REL_GAP:
            print(f"{name}: seed {seed} rejected in the batched check {gaps}")
            continue
        return seed, model, ids, logits, out_gen, gaps, [n for _, n in rows]
    raise RuntimeError(f"{name}: no seed in range({MAX_SEEDS}) gives tie-free Top-K decisions")


def build_glm5(name: str, out: Path = OUT) -> None:
    text = GLM5_TEXT[name]
    seed, model, ids, logits, out_gen, gaps, redraws = draw_tie_free(
        name, lambda: glm5_next(text), glm5_randomize_, 1000, TopkGaps, glm5_generate
    )
    clamps = clamp_fractions(model, ids, text["swiglu_limit"])
    assert set(clamps) == {"dense", "shared", "routed"} and all(g > 0 and u > 0 for g, u in clamps.values()), clamps
    gen_tokens = out_gen.sequences[:, SEQ:].numpy()
    extra = {"seed": seed, "min_rel_gaps": {k: round(v, 6) for k, v in sorted(gaps.items())}}
    size = write_fixture(out / name, model, ids, logits, gen_tokens, extra)
    print(f"{name}: seed {seed}, prompt ids redrawn {redraws} times per row")
    listed = ", ".join(f"{k} {v:.2e}" for k, v in sorted(gaps.items()))
    print(f"{name}: min relative Top-K / argmax gaps (need >= {MIN_REL_GAP}): {listed}")
    print(
        f"{name}: swiglu_limit {text['swiglu_limit']} clamps (gate > limit, |up| > limit): "
        + ", ".join(f"{k} {g:.1%}/{u:.1%}" for k, (g, u) in clamps.items())
    )
    print(f"{name}: {size / 1e6:.2f} MB, logits {logits.shape}, generated {gen_tokens.tolist()}")


# ---------------------------------------------------------------------------------------------------------------------
# Qwen3-Next (`qwen3_next`): Gated DeltaNet (grouped q/k heads, K != V) + gated GQA (partial RoPE) + softmax MoE with a
# gated shared expert, zero-centred norms. Awkward sizes: 6 value heads over 2 key heads, an odd hidden size, a
# prompt of 77 tokens (not a multiple of the 64-token chunk).

QWEN3_NEXT = {
    "vocab_size": 160,
    "hidden_size": 45,
    "intermediate_size": 40,
    "num_hidden_layers": 5,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 20,
    "mlp_only_layers": [0],
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "pad_token_id": 159,
    "bos_token_id": 157,
    "eos_token_id": 158,
    "tie_word_embeddings": False,
}


class RouterGaps:
    """While active, records for every MoE router Top-K of a Qwen model the relative gap at the selection boundary
    of its softmax probabilities, per (batch row, position): `records` holds ("expert", layer, gaps [B, S])."""

    def __init__(self, model: torch.nn.Module):
        self.records: list[tuple[str, int, torch.Tensor]] = []
        self.handles = []
        self.shape: tuple[int, int] = (0, 0)  # [B, S] of the MoE block running now (its router sees [B * S, D])
        for name, mod in model.named_modules():
            if type(mod).__name__ in ("Qwen3NextSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock"):
                layer = int(name.split("layers.")[1].split(".")[0])
                self.handles.append(mod.register_forward_pre_hook(self._block))
                self.handles.append(mod.gate.register_forward_hook(self._router(layer)))

    def _block(self, _, args):
        self.shape = tuple(args[0].shape[:2])

    def _router(self, layer):
        def hook(router, _args, out):
            probs = torch.softmax(out[0].float(), dim=-1)
            self.records.append(("expert", layer, rel_topk_gap(probs, router.top_k).view(*self.shape)))

        return hook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    min_by_kind = TopkGaps.min_by_kind
    min_per_row = TopkGaps.min_per_row


def qwen_randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter seeded random: zero-centred RMSNorm weights (applied as 1 + w) get 0.1 N(0, 1), the gated
    norm's (applied as w) 1 + 0.1 N(0, 1), A_log / dt_bias a perturbation, matrices std 0.5 / sqrt(fan_in) (the
    router 1.5, to spread its softmax)."""

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.startswith("model.visual."):  # the vision tower: unused by text inference, left as initialised
                continue
            if name.endswith("linear_attn.norm.weight"):
                new = 1.0 + 0.1 * randn(p.shape)
            elif "norm" in name:
                new = 0.1 * randn(p.shape)
            elif leaf in ("A_log", "dt_bias"):
                new = p + 0.1 * randn(p.shape)
            elif name.endswith("embed_tokens.weight"):
                new = randn(p.shape)
            elif p.dim() >= 2:
                fan_in = p.shape[-1] if p.dim() == 3 else int(np.prod(p.shape[1:]))
                gain = 1.5 if name.endswith("mlp.gate.weight") else 0.5
                new = gain / fan_in**0.5 * randn(p.shape)
            else:
                raise ValueError(f"no randomisation rule for {name} {tuple(p.shape)}")
            p.copy_(new)


def qwen_generate(model, ids: torch.Tensor):
    pad = getattr(model.config, "text_config", model.config).pad_token_id
    return model.generate(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=pad,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip


# Qwen3.5-MoE (`qwen3_5_moe`, text part): qwen3_next's sizes without the dense layer (every FFN MoE); 4 value heads
# over 2 key heads; RoPE with multimodal sections (plain for text); a tiny (unused) vision tower.
QWEN3_5_MOE_TEXT = {
    **{k: v for k, v in QWEN3_NEXT.items() if k not in ("intermediate_size", "mlp_only_layers", "decoder_sparse_step",
                                                        "norm_topk_prob", "rope_parameters")},
    "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}  # fmt: skip
QWEN3_5_VISION = {
    "depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 45, "intermediate_size": 32, "patch_size": 2,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16,
}  # fmt: skip


def qwen_model(name: str):
    """A Qwen model of the fixture `name` (eager attention and experts: the grouped-mm path needs 16-byte strides)."""
    import transformers as tf

    kw = dict(attn_implementation="eager", experts_implementation="eager")
    if name == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**QWEN3_NEXT, **kw))
    cfg = tf.Qwen3_5MoeConfig(text_config=dict(QWEN3_5_MOE_TEXT), vision_config=dict(QWEN3_5_VISION), **kw)
    return tf.Qwen3_5MoeForConditionalGeneration(cfg)


def build_qwen3_next(name: str = "qwen3_next", out: Path = OUT) -> None:
    seed, model, ids, logits, out_gen, gaps, redraws = draw_tie_free(
        name, lambda: qwen_model(name), qwen_randomize_, 2000, RouterGaps, qwen_generate
    )
    gen_tokens = out_gen.sequences[:, SEQ:].numpy()
    extra = {"seed": seed, "min_rel_gaps": {k: round(v, 6) for k, v in sorted(gaps.items())}}
    size = write_fixture(out / name, model, ids, logits, gen_tokens, extra)
    listed = ", ".join(f"{k} {v:.2e}" for k, v in sorted(gaps.items()))
    print(f"{name}: seed {seed}, prompt ids redrawn {redraws} times per row; min gaps {listed}")
    print(f"{name}: {size / 1e6:.2f} MB, logits {logits.shape}, generated {gen_tokens.tolist()}")


BUILDERS = {
    "kimi_linear": lambda out: build("kimi_linear", kimi_linear, out),
    "deepseek_v32": lambda out: build("deepseek_v32", deepseek_v32, out),
    "glm5_next_a": lambda out: build_glm5("glm5_next_a", out),
    "glm5_next_b": lambda out: build_glm5("glm5_next_b", out),
    "qwen3_next": lambda out: build_qwen3_next("qwen3_next", out),
    "qwen3_5_moe": lambda out: build_qwen3_next("qwen3_5_moe", out),
}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BUILDERS), help="build only these fixtures")
    parser.add_argument("--out", type=Path, default=OUT, help="fixtures folder (default: tests/fixtures)")
    cli = parser.parse_args()
    for fixture in cli.only or list(BUILDERS):
        BUILDERS[fixture](cli.out)
