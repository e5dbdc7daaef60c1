"""Command line: `hybrid-jax generate` (also `python -m hybrid_jax`)."""

from __future__ import annotations

import argparse
import contextlib
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


def cmd_generate(args: argparse.Namespace) -> int:
    from sharding.launch import initialize, spec_from

    initialize(spec_from(args))  # multi-host: join the job before JAX touches a device
    from hybrid_jax.compilation import CompileCounter, enable_persistent_cache

    if args.compile_cache:
        enable_persistent_cache(args.compile_cache)
    counter = CompileCounter().__enter__()  # everything this command compiles or loads from the cache
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax.generate import generate
    from hybrid_jax.model import HybridLM
    from hybrid_jax.quant.config import QuantConfig
    from hybrid_jax.tokenizer import ByteTokenizer

    quant = QuantConfig.from_yaml(args.quant) if args.quant else None
    if args.model:
        from checkpoints import from_pretrained, load_tokenizer

        model = from_pretrained(args.model, dtype=jnp.dtype(args.dtype), quant=quant)
        cfg = model.config
        tok = _HFTokenizer(load_tokenizer(args.model), cfg)
        print(f"model: {args.model} ({cfg.layer_pattern}), {args.dtype}, device {jax.devices()[0].platform}")
    else:
        cfg = _load_config(args.config)
        tok = ByteTokenizer()
        if cfg.vocab_size < tok.vocab_size:
            raise SystemExit(f"the byte tokenizer needs vocab_size >= {tok.vocab_size}, config has {cfg.vocab_size}")
        print(
            f"model: {args.config} ({cfg.layer_pattern}), random weights from seed {args.seed}, "
            f"device {jax.devices()[0].platform}",
            flush=True,
        )
        model = HybridLM(cfg, quant=quant, rngs=nnx.Rngs(args.seed))
    mesh_ctx = contextlib.nullcontext()
    if args.dp * args.tp > 1:
        from sharding import make_mesh, shard_params

        mesh = make_mesh(dp=args.dp, tp=args.tp)
        model = shard_params(model, mesh)
        print(f"mesh: dp={args.dp} tp={args.tp} over {jax.device_count()} devices in {jax.process_count()} process(es)")
        mesh_ctx = jax.set_mesh(mesh)  # activations follow the sharding rules (sequence-parallel inside TP)
    if args.prompt_ids:
        ids = jnp.asarray([[int(t) for t in args.prompt_ids.split(",")]], jnp.int32)
    elif tok is None:
        raise SystemExit(f"{args.model} has no tokenizer.json: pass the prompt as --prompt-ids 1,2,3")
    else:
        ids = jnp.asarray([tok.encode(args.prompt)], jnp.int32)
    gen = jax.jit(generate, static_argnames=("max_new_tokens", "top_k", "eos_id"))
    eos = tok.eos_id if tok is not None else cfg.eos_token_id
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=eos,
        rng=jax.random.key(args.seed),
    )

    with mesh_ctx:
        t0 = time.perf_counter()
        out = jax.block_until_ready(gen(model, ids, **kw))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = jax.block_until_ready(gen(model, ids, **kw))
        steady = time.perf_counter() - t0

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        out = multihost_utils.process_allgather(out, tiled=True)
        if jax.process_index() != 0:
            return 0  # one report per job
    n = int(out.lengths[0])
    print(f"prompt: {args.prompt_ids or args.prompt!r}")
    if tok is not None:
        print(f"generated: {tok.decode(out.tokens[0, :n])!r}")
    print(f"tokens: {out.tokens[0, :n].tolist()}")
    print(f"{n} tokens in {steady:.3f} s: {n / steady:.1f} tokens/s (first call incl. compilation {first:.2f} s)")
    where = f" (persistent cache: {args.compile_cache})" if args.compile_cache else " (persistent cache off)"
    print(f"XLA compilations: {counter.compiled}, loaded from the persistent cache: {counter.cache_hits}{where}")
    return 0


class _HFTokenizer:
    """The few methods the CLI needs, over a `tokenizers.Tokenizer` (None stays None)."""

    def __new__(cls, tokenizer, cfg):
        if tokenizer is None:
            return None
        self = super().__new__(cls)
        self.tok, self.eos_id, self.bos_id = tokenizer, cfg.eos_token_id, cfg.bos_token_id
        return self

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text).ids
        return ids if self.bos_id is None or ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def cmd_convert(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from checkpoints import convert
    from hybrid_jax.quant.config import QuantConfig

    quant = QuantConfig.from_yaml(args.quant) if args.quant else None
    out = convert(args.hf_dir, args.out_dir, dtype=jnp.dtype(args.dtype), quant=quant, force=args.force)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from sharding.launch import add_arguments as add_distributed_arguments

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
    g.add_argument("--model", default=None, help="Hugging Face or converted folder (instead of --config)")
    g.add_argument("--dtype", default="bfloat16", help="weights/activations dtype with --model")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids (for folders without tokenizer)")
    g.add_argument("--quant", default=None, help="QuantConfig YAML file (indexer / kv_cache / projection)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel mesh size")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel mesh size (dp * tp = all devices)")
    add_distributed_arguments(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("convert", help="convert a Hugging Face folder to an orbax checkpoint (atomic)")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--quant", default=None, help="QuantConfig YAML; projection: fp8 stores FP8-resident weights")
    c.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["generate", *argv]  # `hybrid-jax` alone runs the default job
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
