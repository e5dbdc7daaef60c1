"""How far bf16 is from float32 at a released model's full widths, for transformers and for this engine (CPU).

The e2e benchmark's parity row compares two bf16 engines; this says how much of their gap is each engine's own
bf16 rounding. A transformers-built model (`benchmarks.e2e_transformers`' configs: `--arch kimi|glm5|qwen3_next`, fewer
layers and experts, a small vocabulary) with random weights is saved in float32 and in bf16; the last-token
logits of a 64-token prompt are computed by transformers in both dtypes, then by this engine from both folders.

    /path/to/torch-python scripts/bf16_parity.py torch OUT [--arch glm5 --layers 4 --experts 8 --vocab 4096]
    python scripts/bf16_parity.py jax OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def torch_side(out: Path, arch: str, layers: int, experts: int, vocab: int) -> None:
    import torch

    from benchmarks.e2e_transformers import ARCHS, _model_class

    config_fn, cls = ARCHS[arch]
    torch.manual_seed(0)
    model = _model_class(cls)(config_fn(layers, experts, vocab)).eval()
    model.save_pretrained(out / "float32", safe_serialization=True)
    ids = torch.randint(0, vocab - 8, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        f32 = model(ids).logits[0, -1].double().numpy()
        model = model.to(torch.bfloat16)
        bf16 = model(ids).logits[0, -1].double().numpy()
    model.save_pretrained(out / "bfloat16", safe_serialization=True)
    np.savez(out / "reference.npz", ids=ids.numpy(), float32=f32, bfloat16=bf16)
    print(f"transformers bf16 vs float32: {rel(bf16, f32):.2e}")


def jax_side(out: Path) -> None:
    import jax
    import jax.numpy as jnp

    from checkpoints import from_pretrained

    ref = np.load(out / "reference.npz")
    ids = jnp.asarray(ref["ids"])
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        model = from_pretrained(out / name, dtype=dtype, progress=False)
        lg = np.asarray(jax.jit(lambda m, i: m(i)[0, -1].astype(jnp.float32))(model, ids), np.float64)
        print(f"hybrid-jax {name} vs transformers float32: {rel(lg, ref['float32']):.2e}; "
              f"vs transformers {name}: {rel(lg, ref[name]):.2e}")  # fmt: skip
        del model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("side", choices=["torch", "jax"])
    p.add_argument("out", type=Path)
    p.add_argument("--arch", choices=["kimi", "glm5", "qwen3_next"], default="glm5")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args()
    if args.side == "torch":
        if args.out.exists():
            raise SystemExit(f"bf16_parity: {args.out} exists; remove it or choose another folder")
        torch_side(args.out, args.arch, args.layers, args.experts, args.vocab)
    else:
        jax_side(args.out)


if __name__ == "__main__":
    main()
