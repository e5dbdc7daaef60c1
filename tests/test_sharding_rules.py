"""The logical -> mesh axis table."""

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hybrid_jax import HybridConfig, HybridLM
from sharding import logical_to_spec, param_partition_specs


def test_logical_names_map_to_mesh_axes_present_in_the_mesh():
    assert logical_to_spec(("expert", "embed", "expert_mlp")) == P("ep", None, "tp")
    assert logical_to_spec(("expert", "embed", "expert_mlp"), mesh_axis_names=("dp", "tp")) == P(None, None, "tp")
    rules = {"batch": ("dp", "ep"), "seq": "cp"}
    assert logical_to_spec(("batch", "seq", None), rules=rules) == P(("dp", "ep"), "cp", None)


def test_bad_rules_are_named():
    with pytest.raises(ValueError, match="logical axis 'bogus'"):
        logical_to_spec(("bogus",))
    with pytest.raises(ValueError, match="mesh axis 'tp' would shard two dimensions"):
        logical_to_spec(("heads", "mlp"))


def test_every_parameter_gets_a_spec():
    model = nnx.eval_shape(lambda: HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(0)))
    specs = param_partition_specs(model, mesh_axis_names=("dp", "cp", "tp"))
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    assert specs["layers"][2]["self_attn"]["kv_b_proj"]["kernel"] == P(None, "tp")
    assert specs["layers"][0]["self_attn"]["A_log"] == P("tp")
