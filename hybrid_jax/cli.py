"""Command line: `hybrid-jax generate` and `hybrid-jax convert` (also `python -m hybrid_jax`).

A user error (a bad flag value, a missing folder, an id outside the vocabulary, a mesh that does not fit the
devices) prints one line, `hybrid-jax: error: ...`, and exits with status 2; values are checked on the host
before anything is compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "The hybrid model reads"
PROG = "hybrid-jax"


class UserError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose own errors (an unknown flag, a value of the wrong type) are one line too."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message}\n")


def _checked(kind: type, ok, rule: str):
    """An argparse type: `kind(text)` that must satisfy `ok`, else a one-line error naming the value (argparse
    puts the flag's name before it)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):  # NaN fails every comparison: refused too
            raise argparse.ArgumentTypeError(f"{value} {rule}")
        return value

    return parse


_positive = _checked(int, lambda v: v >= 1, "must be at least 1")
_probability = _checked(float, lambda v: 0.0 < v <= 1.0, "must lie in (0, 1]")
_temperature = _checked(float, lambda v: v >= 0.0, "must be >= 0 (0 is greedy)")


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    return ids


def _load_config(name_or_path: str):
    from hybrid_jax.config import PRESETS, HybridConfig

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    path = Path(name_or_path)
    if path.is_file():
        return HybridConfig.from_json(path)
    raise UserError(f"--config {name_or_path!r}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")


def _load_quant(path: str | None):
    from hybrid_jax.quant.config import QuantConfig

    if path is None:
        return None
    if not Path(path).is_file():
        raise UserError(f"--quant {path!r}: no such file")
    return QuantConfig.from_yaml(path)


class _Printer:
    """Prints (or streams) what the command says; --quiet keeps only the generated text."""

    def __init__(self, quiet: bool, main_process: bool):
        self.quiet, self.on = quiet, main_process

    def info(self, text: str, *, err: bool = False) -> None:
        if self.on and not self.quiet:
            print(text, file=sys.stderr if err else sys.stdout, flush=True)


class _Stream:
    """on_token for `generate`: prints row 0's text as it is generated (incrementally decoded)."""

    def __init__(self, tok, eos_id: int | None, pad_id: int):
        self.tok, self.eos_id, self.pad_id = tok, eos_id, pad_id
        self.ids: list[int] = []
        self.shown = ""
        self.stopped = False

    def __call__(self, step, tokens) -> None:
        tok_id = int(tokens[0])
        if self.stopped:
            return
        if tok_id == self.eos_id:
            self.stopped = True
            return
        self.ids.append(tok_id)
        if self.tok is None:
            print(f"{tok_id} ", end="", flush=True)
            return
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character not complete yet
            return
        print(text[len(self.shown) :], end="", flush=True)
        self.shown = text

    def finish(self) -> None:
        """Print what an incomplete character held back, then end the line."""
        if self.tok is not None:
            print(self.tok.decode(self.ids)[len(self.shown) :], end="")
        print(flush=True)


def _agreed_prefill_chunk(model) -> int:
    """`default_prefill_chunk` on this host; with several processes, the smallest over them (the chunk
    shapes the compiled program, which must be the same on every host)."""
    import jax
    import numpy as np

    from hybrid_jax.generate import default_prefill_chunk

    chunk = default_prefill_chunk(model)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        from sharding.launch import barrier

        barrier("prefill-chunk")  # the allgather is a collective: hosts that load at different speeds meet first
        chunk = int(np.min(multihost_utils.process_allgather(np.int32(chunk))))
    return chunk


def cmd_generate(args: argparse.Namespace) -> int:
    from sharding.launch import barrier, initialize, spec_from

    try:
        initialize(spec_from(args))  # multi-host: join the job before JAX touches a device
    except ValueError as e:
        raise UserError(str(e)) from None
    from hybrid_jax import recall

    embedded = args.model is None and args.config is None  # no model named: the shipped recall model
    if embedded:
        if not (recall.MODEL_DIR / "model.safetensors").is_file():
            raise UserError(f"the embedded model is missing from {recall.MODEL_DIR}: run scripts/train_recall.py")
        args.model = str(recall.MODEL_DIR)
    if args.model is not None and not Path(args.model).is_dir():
        raise UserError(f"--model {args.model!r}: no such folder")
    if args.prompt is None:
        args.prompt = recall.DEFAULT_PROMPT if embedded else DEFAULT_PROMPT
    quant = _load_quant(args.quant)
    cfg = None if args.model else _load_config(args.config)

    from hybrid_jax.compilation import CompileCounter, enable_persistent_cache

    if args.compile_cache:
        enable_persistent_cache(args.compile_cache)
    import jax

    devices = jax.device_count()
    if args.dp * args.tp not in (1, devices):
        raise UserError(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} devices; this job has {devices}")
    say = _Printer(args.quiet, jax.process_index() == 0)
    counter = CompileCounter().__enter__()  # everything this command compiles or loads from the cache
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax.generate import generate
    from hybrid_jax.model import HybridLM
    from hybrid_jax.tokenizer import ByteTokenizer

    if args.model:
        from checkpoints import from_pretrained, load_tokenizer

        model = from_pretrained(args.model, dtype=args.dtype, quant=quant, mtp=True if args.draft == "mtp" else None)
        cfg = model.config
        tok = _HFTokenizer(load_tokenizer(args.model), cfg)
        dtype = jnp.dtype(model.dtypes.compute).name
        name = f"the embedded recall model ({args.model})" if embedded else args.model
        say.info(f"model: {name} ({cfg.layer_pattern}), {dtype}, device {jax.devices()[0].platform}")
    else:
        tok = ByteTokenizer()
        if cfg.vocab_size < tok.vocab_size:
            raise UserError(f"the byte tokenizer needs vocab_size >= {tok.vocab_size}, config has {cfg.vocab_size}")
        dtypes = {} if args.dtype == "auto" else dict(dtype=jnp.dtype(args.dtype), param_dtype=jnp.dtype(args.dtype))
        model = HybridLM(cfg, quant=quant, rngs=nnx.Rngs(args.weights_seed), **dtypes)
        say.info(
            f"model: {args.config} ({cfg.layer_pattern}), random weights from --weights-seed {args.weights_seed}, "
            f"{jnp.dtype(model.dtypes.compute).name}, device {jax.devices()[0].platform}"
        )
    if args.prompt_ids is not None:
        ids = args.prompt_ids
    elif tok is None:
        raise UserError(f"{args.model} has no tokenizer.json: pass the prompt as --prompt-ids 1,2,3")
    else:
        ids = tok.encode(args.prompt)
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if args.top_k is not None and args.top_k > cfg.vocab_size:
        raise UserError(f"--top-k {args.top_k} exceeds the vocabulary size {cfg.vocab_size}")
    total = len(ids) + args.max_new_tokens
    extra = f" + --num-draft {args.num_draft}" if args.draft else ""
    if total + (args.num_draft if args.draft else 0) > cfg.max_position_embeddings:
        raise UserError(
            f"prompt {len(ids)} + --max-new-tokens {args.max_new_tokens}{extra} = "
            f"{total + (args.num_draft if args.draft else 0)} tokens exceeds "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    mesh_ctx = contextlib.nullcontext()
    if args.dp * args.tp > 1:
        from sharding import make_mesh, shard_params

        mesh = make_mesh(dp=args.dp, tp=args.tp)
        model = shard_params(model, mesh)
        say.info(f"mesh: dp={args.dp} tp={args.tp} over {devices} devices in {jax.process_count()} process(es)")
        mesh_ctx = jax.set_mesh(mesh)  # activations follow the sharding rules (sequence-parallel inside TP)

    eos = tok.eos_id if tok is not None else cfg.eos_token_id
    stream = _Stream(tok, eos, 0) if args.stream and say.on else None
    static = dict(
        max_new_tokens=args.max_new_tokens, top_k=args.top_k, eos_id=eos, on_token=stream, draft=args.draft,
        num_draft=args.num_draft,
        prefill_chunk=args.prefill_chunk if args.prefill_chunk is not None else _agreed_prefill_chunk(model),
    )  # fmt: skip
    dynamic = dict(temperature=args.temperature, top_p=args.top_p, rng=jax.random.key(args.seed))
    prompt = jnp.asarray([ids], jnp.int32)
    gen = jax.jit(generate, static_argnames=tuple(static))
    with mesh_ctx:
        where = f"persistent cache {args.compile_cache}" if args.compile_cache else "persistent cache off"
        say.info(f"compiling generate ({where}) ...", err=True)
        t0 = time.perf_counter()
        compiled = gen.lower(model, prompt, **static, **dynamic).compile()
        compile_s = time.perf_counter() - t0
        barrier("generate-compiled")  # hosts compile at different speeds; run together
        if stream is not None and not args.quiet:
            print("generated: ", end="", flush=True)
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(model, prompt, **dynamic))
        jax.effects_barrier()  # the streamed tokens are printed before the summary
        run_s = time.perf_counter() - t0
    if stream is not None:
        stream.finish()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        out = multihost_utils.process_allgather(out, tiled=True)
        if jax.process_index() != 0:
            return 0  # one report per job
    n = int(out.lengths[0])
    text = tok.decode(out.tokens[0, :n]) if tok is not None else None
    if args.quiet:
        if stream is None:
            print(text if text is not None else ",".join(str(int(i)) for i in out.tokens[0, :n]))
        return 0
    say.info(f"prompt: {args.prompt if args.prompt_ids is None else args.prompt_ids!r}")
    if text is not None and stream is None:
        say.info(f"generated: {text!r}")
    say.info(f"tokens: {out.tokens[0, :n].tolist()}")
    # the recall model, named or not: check its answer when the prompt is in the task's format
    if Path(args.model or "").resolve() == recall.MODEL_DIR.resolve() and args.prompt_ids is None:
        expected = recall.expected_answer(args.prompt)
        if expected is None:
            say.info("recall: the prompt is not in the key:value format (ab:17 cd:42 ?cd:); nothing to check")
        else:
            verdict = "right" if text == expected else f"wrong: expected {expected!r}"
            say.info(f"recall: asked for {args.prompt[-3:-1]!r}, answered {text!r} ({verdict})")
    say.info(f"{n} tokens in {run_s:.3f} s: {n / run_s:.1f} tokens/s (compilation {compile_s:.2f} s, before that)")
    if args.draft:
        say.info(f"speculative ({args.draft}): {int(out.accepted[0])} of {int(out.drafted[0])} drafted tokens accepted")
    say.info(f"XLA compilations: {counter.compiled}, loaded from the persistent cache: {counter.cache_hits} ({where})")
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
    if not Path(args.hf_dir).is_dir():
        raise UserError(f"{args.hf_dir!r}: no such folder")
    if Path(args.out_dir).exists() and not args.force:
        raise UserError(f"{args.out_dir!r} exists; pass --force to replace it")
    quant = _load_quant(args.quant)
    from checkpoints import convert

    out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, quant=quant, force=args.force, mtp=args.mtp or None)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hybrid_jax.recall import DEFAULT_PROMPT as recall_prompt
    from sharding.launch import add_arguments as add_distributed_arguments

    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=fmt)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    g = sub.add_parser(
        "generate",
        help="generate text with a model (default: the embedded recall model)",
        description="Generate text after a prompt: greedy (--temperature 0) or sampled.",
        formatter_class=fmt,
    )
    g.add_argument(
        "--config", default=None,
        help="preset name or HybridConfig JSON file, with random weights (default: the embedded recall model)",
    )  # fmt: skip
    g.add_argument("--model", default=None, help="a Hugging Face or converted (orbax) folder, instead of --config")
    g.add_argument(
        "--dtype",
        default="auto",
        help="compute and weight dtype; auto: the checkpoint's own dtype (float32 for --config)",
    )
    g.add_argument(
        "--prompt", default=None,
        help=f"prompt text (default: {recall_prompt!r} for the embedded model, {DEFAULT_PROMPT!r} otherwise)",
    )  # fmt: skip
    g.add_argument(
        "--prompt-ids", type=_prompt_ids, default=None, help="the prompt as comma-separated token ids, e.g. 1,2,3"
    )
    g.add_argument("--max-new-tokens", type=_positive, default=32, help="tokens to generate")
    g.add_argument("--temperature", type=_temperature, default=0.0, help="sampling temperature; 0 is greedy")
    g.add_argument("--top-k", type=_positive, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=_probability, default=None, help="nucleus sampling: smallest set of mass >= p")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling (not of the weights)")
    g.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights of a --config preset")
    g.add_argument(
        "--prefill-chunk",
        type=_positive,
        default=None,
        help="prefill longer prompts this many tokens at a time (default: from the model's sizes and free memory)",
    )
    g.add_argument(
        "--draft", choices=["ngram", "mtp"], default=None,
        help="speculative decoding: draft tokens by prompt lookup (ngram) or the checkpoint's multi-token-prediction "
        "layer (mtp), verify them in one forward (same greedy output)",
    )  # fmt: skip
    g.add_argument("--num-draft", type=_positive, default=4, help="tokens drafted per verify step (with --draft)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--quiet", action="store_true", help="print only the generated text")
    g.add_argument(
        "--compile-cache",
        default=os.path.expanduser("~/.cache/hybrid_jax/jit"),
        help="JAX persistent compilation cache folder ('' to disable)",
    )
    g.add_argument("--quant", default=None, help="QuantConfig YAML file (indexer / kv_cache / projection)")
    g.add_argument("--dp", type=_positive, default=1, help="data-parallel mesh size")
    g.add_argument("--tp", type=_positive, default=1, help="tensor-parallel mesh size (dp x tp = devices)")
    add_distributed_arguments(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser(
        "convert",
        help="convert a Hugging Face folder to an orbax checkpoint (atomic)",
        description="Convert a Hugging Face folder to an orbax checkpoint; nothing is left half-written.",
        formatter_class=fmt,
    )
    c.add_argument("hf_dir", help="the Hugging Face folder (config.json + safetensors)")
    c.add_argument("out_dir", help="the orbax folder to write")
    c.add_argument("--dtype", default="auto", help="weight dtype to store; auto: the checkpoint's own dtype")
    c.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    c.add_argument("--quant", default=None, help="QuantConfig YAML; projection: fp8 stores FP8-resident weights")
    c.add_argument(
        "--mtp", action="store_true", help="keep the checkpoint's multi-token-prediction layer (for --draft mtp)"
    )
    c.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["generate", *argv]  # `hybrid-jax` alone runs the default job
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, ValueError, OSError) as e:
        # UserError, and what a bad config, checkpoint or quant file raises (ValueError / CheckpointError,
        # a missing or unreadable file): one line. HYBRID_JAX_DEBUG=1 shows the traceback instead.
        if os.environ.get("HYBRID_JAX_DEBUG"):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
