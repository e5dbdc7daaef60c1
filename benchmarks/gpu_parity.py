"""The whole model through its kernels against the same model through the jnp references, on the device.

Unit tests check every kernel against its reference in interpret mode on small shapes; on a GPU, `impl="auto"`
picks tiles, warps and stages from the widths it sees (128 heads, a 576-wide latent, 64 indexer heads), and a
tile that does not fit the shared memory only shows there (the FP8-row sparse MLA tile with float32 queries
did, acb2fd9). Here each preset's widths run once through the kernels (the GPU defaults) and once inside
`use_pallas(False)`, with the same parameters and cache layout:

- a random model of the preset's widths, layers and experts cut to fit one device (`--layers`, `--experts`);
- a prompt of `--prompt` tokens (past the indexer's top-k, so the sparse layers select), then `--steps`
  decode steps fed the reference's greedy tokens (teacher forcing: both paths see the same inputs);
- reported: the relative error of the prefill's last-position logits and the worst decode step's, and how
  many of the greedy tokens agree (random weights give flat logits, so a flip on a near-tie can happen
  while the error stays small). A case whose kernels fail to compile or run is a row, not a crash.

    python -m benchmarks.gpu_parity                                   # every case below
    python -m benchmarks.gpu_parity --cases deepseek_v32:float32:none --prompt 2500 --steps 2
    python -m benchmarks.gpu_parity --cases --recall 500              # only the trained model below

The embedded recall model (hybrid_jax/assets/recall, trained weights) is the check random weights cannot
make: `--recall N` fresh associative-recall queries (1-24 pairs) answered through `generate` — float32 through
the references, bf16 through the kernels, bf16 through the kernels with the hierarchical quantization — and
the share answered right (the CPU golden tests require >= 97% of the same kind of queries).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import jit_module, report

# preset:dtype:quant, most shared-memory-hungry widths first (DeepSeek's 128 heads)
CASES = (
    "deepseek_v32:bfloat16:none",
    "deepseek_v32:float32:none",
    "deepseek_v32:bfloat16:hierarchical",
    "glm5_next_flash:bfloat16:none",
    "glm5_next_flash:bfloat16:hierarchical",
    "qwen3_next_80b:bfloat16:none",
    "qwen3_next_80b:bfloat16:hierarchical",
    "qwen3_5_moe_35b:bfloat16:none",
    "kimi_linear_48b:bfloat16:none",
    "kimi_linear_48b:float32:none",
    "hybrid_small:bfloat16:none",
    "hybrid_small:float32:none",
    "hybrid_small:bfloat16:hierarchical",
)


def cut_config(cfg, layers: int, experts: int):
    """The preset's widths with its first `layers` layers (all if fewer), plus the first layer of each
    attention and MLP type they lack, and at most `experts` routed experts (groups cut to keep >= 2 experts each)."""
    keep = list(range(min(layers, cfg.num_layers)))
    for types in (cfg.layer_types, cfg.mlp_types):  # e.g. Kimi's first MLA layer is its fourth
        for kind in dict.fromkeys(types):
            if kind not in {types[i] for i in keep}:
                keep.append(types.index(kind))
    keep = sorted(set(keep))
    changes = dict(
        num_layers=len(keep),
        layer_types=tuple(cfg.layer_types[i] for i in keep),
        mlp_types=tuple(cfg.mlp_types[i] for i in keep),
    )
    if cfg.attn_res_block_size is not None:
        changes["attn_res_block_size"] = min(cfg.attn_res_block_size, len(keep))
    if cfg.indexer_types is not None:  # a shared layer whose full predecessor is cut runs its own indexer
        changes["indexer_types"] = tuple(
            "full" if j == 0 or keep[j - 1] != i - 1 else cfg.indexer_types[i] for j, i in enumerate(keep)
        )
    if cfg.num_experts > experts:
        n_group = cfg.n_group
        while n_group > 1 and experts // n_group < 2:
            n_group //= 2
        per_group = experts // n_group
        changes.update(num_experts=experts, n_group=n_group, topk_group=min(cfg.topk_group, n_group))
        changes["num_experts_per_tok"] = min(cfg.num_experts_per_tok, changes["topk_group"] * per_group)
    return cfg.replace(**changes)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_case(case: str, args) -> dict:
    from flax import nnx

    from hybrid_jax import PRESETS, HybridLM
    from hybrid_jax.quant.config import QuantConfig
    from pallas_kernels import use_pallas

    name, dtype_name, quant_name = case.split(":")
    if name not in PRESETS or quant_name not in ("none", "hierarchical"):
        raise SystemExit(f"gpu_parity: unknown case {case!r}; expected PRESET:DTYPE:none|hierarchical")
    dtype = jnp.dtype(dtype_name)
    cfg = cut_config(PRESETS[name](), args.layers, args.experts)
    quant = QuantConfig.hierarchical() if quant_name == "hierarchical" else None
    row = dict(preset=name, dtype=dtype_name, quant=quant_name, layers="".join(t[0] for t in cfg.layer_types),
               experts=cfg.num_experts)  # fmt: skip
    t0 = time.perf_counter()
    page = cfg.page_size
    max_len = -(-(args.prompt + args.steps + 1) // page) * page
    ids = jax.random.randint(jax.random.key(1), (1, args.prompt), 0, cfg.vocab_size - 8, jnp.int32)

    def run(kernels: bool):
        """(prefill's last logits, [steps] decode logits) with the kernels or the references; the decode
        tokens are the reference's greedy ones (`tokens`, filled by the reference run, which goes first)."""
        with paths(kernels):
            prefill = jit_module(lambda m, x, c: m.prefill(x, c, last_only=True), model)
            step = jit_module(lambda m, x, c: m.decode_step(x, c), model)
            logits, cache = prefill(ids, model.init_cache(1, max_len))
            out = [np.asarray(logits[0], np.float32)]
            for i in range(args.steps):
                if not kernels:
                    tokens.append(int(np.argmax(out[-1])))
                logits, cache = step(jnp.asarray([tokens[i]], jnp.int32), cache)
                out.append(np.asarray(logits[0], np.float32))
        return out

    def paths(kernels: bool):
        """The references: use_pallas(False); the kernels: as `impl="auto"` picks them (forced on a CPU)."""
        if not kernels:
            return use_pallas(False)
        return use_pallas(True) if args.force_kernels else contextlib.nullcontext()

    tokens: list[int] = []
    try:
        model = HybridLM(cfg, dtype=dtype, param_dtype=dtype, quant=quant, rngs=nnx.Rngs(0))
        ref = run(False)
        got = run(True)
    except Exception as e:  # noqa: BLE001 — a model or kernel that does not build or run is a result here
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return dict(row, prefill_err="", decode_err="", greedy="", note=f"FAILED {type(e).__name__}: {first[:160]}")
    agree = sum(int(np.argmax(g) == np.argmax(r)) for g, r in zip(got, ref, strict=True))
    return dict(
        row,
        prefill_err=f"{_rel(got[0], ref[0]):.1e}",
        decode_err=f"{max(_rel(g, r) for g, r in zip(got[1:], ref[1:], strict=True)):.1e}" if args.steps else "",
        greedy=f"{agree}/{len(ref)}",
        note=f"{time.perf_counter() - t0:.0f} s",
    )


def recall_rows(n: int, force_kernels: bool) -> list[dict]:
    """Accuracy of the shipped recall model on n fresh queries, per path (see the module docstring)."""
    from checkpoints import from_pretrained
    from hybrid_jax import ByteTokenizer, generate, recall
    from hybrid_jax.quant.config import QuantConfig
    from pallas_kernels import use_pallas

    rng = np.random.default_rng(7)
    queries = [recall.sample(rng, int(rng.integers(1, 25))) for _ in range(n)]
    ids, lengths = recall.encode_batch(queries, with_answers=False)
    rows = []
    for name, dtype, quant, kernels in (
        ("references", "float32", None, False),
        ("kernels (auto)", "bfloat16", None, True),
        ("kernels (auto)", "bfloat16", QuantConfig.hierarchical(), True),
    ):
        t0 = time.perf_counter()
        model = from_pretrained(recall.MODEL_DIR, dtype=dtype, quant=quant, progress=False)
        with (use_pallas(True) if force_kernels else contextlib.nullcontext()) if kernels else use_pallas(False):
            run = jax.jit(lambda m, i, k: generate(m, i, prompt_lengths=k, max_new_tokens=2, eos_id=257))
            out = np.asarray(run(model, jnp.asarray(ids), jnp.asarray(lengths)).tokens)
        right = np.array([ByteTokenizer().decode(o) == q.answer for o, q in zip(out, queries, strict=True)])
        pairs = np.array([q.prompt.count(":") - 1 for q in queries])
        worst = min(float(right[pairs == k].mean()) for k in np.unique(pairs))
        rows.append(dict(path=name, dtype=dtype, quant="hierarchical" if quant else "none", queries=n,
                         right=f"{right.mean():.3f}", worst_pair_count=f"{worst:.2f}",
                         note=f"{time.perf_counter() - t0:.0f} s"))  # fmt: skip
        print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases", nargs="*", default=list(CASES), help="PRESET:DTYPE:QUANT (quant none|hierarchical); none: skip"
    )
    p.add_argument("--prompt", type=int, default=3000, help="prompt tokens (past the indexer's top-k of 2048)")
    p.add_argument("--steps", type=int, default=4, help="decode steps after the prompt")
    p.add_argument("--layers", type=int, default=2, help="first layers kept (plus one of each attention type)")
    p.add_argument("--experts", type=int, default=16, help="routed experts kept")
    p.add_argument("--force-kernels", action="store_true", help="`use_pallas()`: kernels also where auto would not")
    p.add_argument("--recall", type=int, default=500, help="queries for the trained recall model (0: skip it)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if jax.default_backend() == "cpu" and not args.force_kernels:
        raise SystemExit(
            "gpu_parity: on a CPU `impl='auto'` runs the references; pass --force-kernels (interpret mode)"
        )
    rows = []
    for case in args.cases:
        rows.append(run_case(case, args))
        print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    title = (
        f"Whole model, kernels (`impl='auto'`) against the jnp references: prompt {args.prompt} + {args.steps} "
        f"decode steps, first {args.layers} layers (+ one of each attention type), <= {args.experts} experts"
    )
    if rows:
        report("gpu_parity.py", title, rows, record=not args.no_record)
    if args.recall:
        title = "The trained recall model (hybrid_jax/assets/recall): share of fresh recall queries answered right"
        report("gpu_parity.py", title, recall_rows(args.recall, args.force_kernels), record=not args.no_record)


if __name__ == "__main__":
    main()
