"""Export of DeepSeek-V3 routing whose group top-k keeps every group (``--moe-router-group-topk`` equal
to ``--moe-router-num-groups``): it limits nothing, so it is written as ungrouped routing and gives
transformers' logits, where it used to be refused unless top-k / group-top-k was 2; a group-top-k
below the group count still needs that ratio."""

import json

import pytest
import torch

from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint
from megatron_lite.checkpoint.hf_deepseek import check_deepseek
from megatron_lite.errors import ConfigError
from tests.convert_helpers import convert
from tests.unit.test_hf_deepseek import OURS, OURS_MOE, TOKENS, VOCAB, save_ours

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")
EVERY_GROUP = {**OURS_MOE, "moe_router_topk": 3, "moe_router_num_groups": 2, "moe_router_group_topk": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_ours(tmp_path_factory.mktemp("ours"), {**OURS, "mtp_num_layers": None}, EVERY_GROUP)


def test_every_group_kept_exports_as_ungrouped_routing_with_the_same_logits(checkpoint, tmp_path):
    out = tmp_path / "hf"
    assert convert("GPT", "--saver", "hf", "--load-dir", checkpoint, "--save-dir", out) == 0
    written = json.loads((out / "config.json").read_text())
    assert (written["n_group"], written["topk_group"], written["num_experts_per_tok"]) == (1, 1, 3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours, _ = load_gpt_checkpoint(checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS)[..., :VOCAB], rtol=1e-5, atol=1e-5)


def test_a_group_topk_below_the_group_count_still_needs_the_ratio_2(checkpoint):
    cfg = merge_checkpoint(checkpoint)[1]
    check_deepseek(cfg)  # every group kept: no ratio needed
    with pytest.raises(ConfigError, match=r"--moe-router-topk 3 / --moe-router-group-topk 1 != 2"):
        check_deepseek({**cfg, "moe_router_group_topk": 1})
