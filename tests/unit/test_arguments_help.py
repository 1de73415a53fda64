"""--help shows Megatron's usual form: ``--num-layers N`` with ``(default: ...)``, not internal names;
the defaults are Megatron-LM's where it has one."""

from megatron_lite.arguments import build_parser, parse_args


def test_help_shows_metavars_and_defaults():
    text = build_parser().format_help()
    assert "--num-layers N" in text and "--lr X" in text
    assert "MODEL." not in text and "OPTIM." not in text and "TRAINING." not in text
    assert "Number of transformer layers. (default: 2)" in text
    assert "--no-check-for-nan-in-loss-and-grad" in text


def test_megatron_defaults():
    config = parse_args(["--mock-data", "--vocab-size", "64"], world_size=1)
    assert config.optim.lr_decay_style == "linear"
    assert config.logging.log_interval == 100
    assert config.training.check_for_nan_in_loss_and_grad
    assert not parse_args(["--mock-data", "--vocab-size", "64", "--no-check-for-nan-in-loss-and-grad"],
                          world_size=1).training.check_for_nan_in_loss_and_grad
