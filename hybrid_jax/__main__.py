import sys

from hybrid_jax.cli import main

sys.exit(main())
