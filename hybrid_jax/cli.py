"""Command line: `hybrid-jax generate` (also `python -m hybrid_jax`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "The hybrid model reads"


def _load_config(name_or_path: str):
    from hybrid_jax.config import PRESETS, HybridConfig

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    path = Path(name_or_path)
    if path.is_file():
        return HybridConfig.from_json(path)
    raise SystemExit(f"--config {name_or_path!r}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")


def _enable_compilation_cache(path: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.compile_cache:
        _enable_compilation_cache(args.compile_cache)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax.generate import generate
    from hybrid_jax.model import HybridLM
    from hybrid_jax.tokenizer import ByteTokenizer

    cfg = _load_config(args.config)
    tok = ByteTokenizer()
    if cfg.vocab_size < tok.vocab_size:
        raise SystemExit(f"the byte tokenizer needs vocab_size >= {tok.vocab_size}, config has {cfg.vocab_size}")
    print(
        f"model: {args.config} ({cfg.layer_pattern}), random weights from seed {args.seed}, "
        f"device {jax.devices()[0].platform}",
        flush=True,
    )
    model = HybridLM(cfg, rngs=nnx.Rngs(args.seed))
    ids = jnp.asarray([tok.encode(args.prompt)], jnp.int32)
    gen = jax.jit(generate, static_argnames=("max_new_tokens", "top_k", "eos_id"))
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tok.eos_id,
        rng=jax.random.key(args.seed),
    )

    t0 = time.perf_counter()
    out = jax.block_until_ready(gen(model, ids, **kw))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(gen(model, ids, **kw))
    steady = time.perf_counter() - t0

    n = int(out.lengths[0])
    print(f"prompt: {args.prompt!r}")
    print(f"generated: {tok.decode(out.tokens[0, :n])!r}")
    print(f"tokens: {out.tokens[0, :n].tolist()}")
    print(f"{n} tokens in {steady:.3f} s: {n / steady:.1f} tokens/s (first call incl. compilation {first:.2f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-jax", description=__doc__)
    sub = p.add_subparsers(dest="command")
    g = sub.add_parser("generate", help="generate text with a model (default: the embedded tiny model)")
    g.add_argument("--config", default="tiny", help="preset name or HybridConfig JSON file (default: tiny)")
    g.add_argument("--prompt", default=DEFAULT_PROMPT)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--compile-cache",
        default=os.path.expanduser("~/.cache/hybrid_jax/jit"),
        help="JAX persistent compilation cache folder ('' to disable)",
    )
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["generate", *argv]  # `hybrid-jax` alone runs the default job
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
