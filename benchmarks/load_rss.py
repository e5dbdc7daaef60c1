"""Host memory while loading a ~1 GB checkpoint with `from_pretrained` (streaming, one tensor at a time).

Writes a random bf16 checkpoint in our `hybrid` format (hybrid_small widths, 4 layers), then loads it in a
fresh process and reports that process's peak RSS against its RSS after imports. On a CPU the loaded
parameters themselves live in host memory, so the number to watch is the overhead above the model's own
bytes; it should stay near the largest (stacked) tensor, not near the checkpoint size.

    python -m benchmarks.load_rss [--layers 4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
import jax.numpy as jnp
from checkpoints import from_pretrained
def status_mb(key):  # VmRSS now / VmHWM peak; ru_maxrss would carry the parent's peak across exec
    line = next(l for l in open('/proc/self/status') if l.startswith(key + ':'))
    return int(line.split()[1]) / 1024
import jax; jax.devices()  # start the backend before the baseline
base = status_mb('VmRSS')
t0 = time.perf_counter()
model = from_pretrained(sys.argv[1], dtype=jnp.bfloat16, progress=False)
secs = time.perf_counter() - t0
peak = status_mb('VmHWM')
print(json.dumps({"base_mb": base, "peak_mb": peak, "seconds": secs}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--keep", default=None, help="write the checkpoint here instead of a temporary folder")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.common import report
    from checkpoints import save_pretrained
    from hybrid_jax import HybridConfig, HybridLM

    n = args.layers
    cfg = HybridConfig.hybrid_small().replace(
        num_layers=n,
        layer_types=tuple("sparse" if i % 4 == 3 else "linear" for i in range(n)),
        mlp_types=("dense",) + ("moe",) * (n - 1),
    )
    model = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    model_mb = sum(x.nbytes for x in leaves) / 2**20
    largest_mb = max(x.nbytes for x in leaves) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp) / "ckpt"
        save_pretrained(model, folder)
        del model, leaves
        ckpt_mb = (folder / "model.safetensors").stat().st_size / 2**20
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(folder)],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    overhead = r["peak_mb"] - r["base_mb"] - model_mb
    rows = [
        {
            "checkpoint MB": f"{ckpt_mb:,.0f}",
            "largest tensor MB": f"{largest_mb:,.0f}",
            "RSS after imports MB": f"{r['base_mb']:,.0f}",
            "peak RSS MB": f"{r['peak_mb']:,.0f}",
            "peak - imports - model MB": f"{overhead:,.0f}",
            "load s": f"{r['seconds']:.1f}",
        }
    ]
    title = f"from_pretrained host memory, hybrid format, bf16, hybrid_small widths with {n} layers"
    report("load_rss.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
