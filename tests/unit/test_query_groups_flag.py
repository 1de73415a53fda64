"""--num-query-groups without --group-query-attention: Megatron-LM ignores it (one key/value group per
head), so a pasted Megatron-LM command with it would silently train another model here (GQA). It is
refused in one line naming both flags; with --group-query-attention, or equal to the head count, it is
accepted."""

import dataclasses

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint.convert import pretrain_flags
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64", "--num-attention-heads", "4", "--hidden-size", "32"]


def test_num_query_groups_without_group_query_attention_is_refused(capsys):
    parse_refused(capsys, BASE + ["--num-query-groups", "2"], "--num-query-groups 2", "--group-query-attention",
                  world_size=1)


def test_with_group_query_attention_it_builds_gqa():
    config = parse_args(BASE + ["--group-query-attention", "--num-query-groups", "2"], world_size=1)
    assert config.model.num_query_groups == 2


def test_one_group_per_head_is_multi_head_attention_either_way():
    plain = parse_args(BASE, world_size=1)
    assert plain.model.num_query_groups == 4  # derived: one group per head, saved with checkpoints
    same = parse_args(BASE + ["--num-query-groups", "4"], world_size=1)
    assert same.model.num_query_groups == 4
    # the converter's printed flags of such a model (num-query-groups = heads, no --group-query-attention) load
    flat = {f.name: getattr(plain.model, f.name) for f in dataclasses.fields(plain.model)}
    flags = pretrain_flags(flat, release=True)
    assert "--num-query-groups" in flags and "--group-query-attention" not in flags
    parse_args(["--mock-data", "--vocab-size", "64"] + flags, world_size=1)


def test_use_checkpoint_args_of_a_gqa_checkpoint_turns_group_query_attention_on(monkeypatch, capsys):
    """--use-checkpoint-args copies --num-query-groups (an architecture flag) but not the switch; a GQA
    checkpoint's groups then come with --group-query-attention instead of being refused."""
    import megatron_lite.checkpoint.arch as arch

    saved = {"num_attention_heads": 4, "hidden_size": 32, "num_query_groups": 2, "group_query_attention": False}
    monkeypatch.setattr(arch, "saved_config", lambda root: (root, saved))
    config = parse_args(BASE + ["--load", "ckpt", "--use-checkpoint-args"], world_size=1)
    assert config.model.group_query_attention and config.model.num_query_groups == 2
    assert "--group-query-attention (was no --group-query-attention)" in capsys.readouterr().out


def test_the_converters_flags_of_a_gqa_model_load():
    """A checkpoint saved before the switch was required (groups 2, no group_query_attention in its
    config): the converter's printed flags add --group-query-attention, so they load."""
    plain = parse_args(BASE + ["--group-query-attention", "--num-query-groups", "2"], world_size=1)
    flat = {f.name: getattr(plain.model, f.name) for f in dataclasses.fields(plain.model)}
    flat["group_query_attention"] = False
    flags = pretrain_flags(flat, release=True)
    assert flags.count("--group-query-attention") == 1
    parse_args(["--mock-data", "--vocab-size", "64"] + flags, world_size=1)


def test_group_query_attention_alone_is_megatrons_multi_query_attention():
    """Megatron-LM's --num-query-groups defaults to 1: --group-query-attention alone builds one key/value
    group (multi-query attention). It was refused here ('needs --num-query-groups'), so a pasted
    Megatron-LM MQA command stopped."""
    from megatron_lite.models.transformer_config import TransformerConfig

    config = parse_args(BASE + ["--group-query-attention"], world_size=1)
    assert config.model.num_query_groups == 1
    assert TransformerConfig.from_config(config).num_query_groups == 1
