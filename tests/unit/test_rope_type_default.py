"""docs/deepseek-v3.md: --rope-type's default is yarn with --multi-latent-attention, else rope."""

from megatron_lite.arguments import parse_args
from megatron_lite.models import TransformerConfig


def test_rope_type_defaults_to_yarn_with_mla_and_rope_without():
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--mock-data", "--vocab-size", "64", "--position-embedding-type", "rope"]
    for extra, want in (([], "rope"), (["--multi-latent-attention"], "yarn"),
                        (["--multi-latent-attention", "--rope-type", "rope"], "rope")):
        assert TransformerConfig.from_config(parse_args(base + extra, world_size=1)).rope_type == want, extra
