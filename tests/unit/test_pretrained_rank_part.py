"""--pretrained-checkpoint at another layout and --moe-use-upcycling read only what a rank holds.

A 4-layer model saved in one process is converted to PP2 (``torch`` format, one model file per
stage). A PP2 rank's chunk is built here in one process (layers 0-1 with the embedding, or layers 2-3
with the final norm and output layer) and filled by the merged route of
megatron_lite/checkpoint/pretrained.py: it reads only its own stage's model file (the tied model's
last stage also the first stage's, for the word embedding) and merges only its own tensors, and what
it loads is the saved model's, bit for bit. Upcycling a dense PP2 checkpoint at the last stage merges
only that stage's dense tensors; grouped experts are built only for the rows a rank holds.
"""

import re

import pytest
import torch

from megatron_lite.checkpoint import merge as merge_module
from megatron_lite.checkpoint import pretrained, upcycle
from megatron_lite.checkpoint.dist import RankTensor, rank_tensors
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.moe.config import MoEConfig, moe_fields
from megatron_lite.parallel.state import ParallelState
from tests.convert_helpers import VOCAB_TENSORS, convert
from tests.inference_helpers import MOE, VARIANTS, VOCAB, build_model, run_config, save_model

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{variant: (PP2 checkpoint folder, the saved single-process model)} for a tied and an untied model."""
    out = {}
    for variant in ("gpt", "rope_gqa"):
        root = tmp_path_factory.mktemp(variant)
        save_model(variant, str(root / "one"))
        assert convert("GPT", "--load-dir", root / "one", "--save-dir", root / "pp2",
                       "--target-pipeline-parallel-size", "2") == 0
        out[variant] = (str(root / "pp2"), build_model(variant))
    return out


def _stage(config, stage: int):
    """PP2 stage ``stage``'s chunk (built in one process, zero weights)."""
    model = GPTModel(TransformerConfig.from_model(config.model), ParallelState(world_size=1, rank=0),
                     pre_process=stage == 0, post_process=stage == 1, layer_start=2 * stage, layer_end=2 * stage + 2)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _spy(monkeypatch):
    """(model files read, names merged): what merge_checkpoint reads and returns from now on."""
    files, names = [], set()
    read, merge = merge_module.read_model_file, pretrained.merge_checkpoint
    monkeypatch.setattr(merge_module, "read_model_file", lambda path: files.append(path) or read(path))

    def merged(*args, **kwargs):
        out = merge(*args, **kwargs)
        names.update(out[0])
        return out

    monkeypatch.setattr(pretrained, "merge_checkpoint", merged)
    return files, names


def _layers(names) -> set:
    return {int(m.group(1)) for n in names if (m := _LAYER.match(n))}


@pytest.mark.parametrize("variant", ["gpt", "rope_gqa"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_pp2_rank_reads_and_merges_only_its_stage(monkeypatch, saved, variant, stage):
    folder, reference = saved[variant]
    config = run_config(variant)
    chunk = _stage(config, stage)
    files, names = _spy(monkeypatch)
    pretrained._load_merged(folder, [chunk], config, ParallelState(world_size=1, rank=0), None, lambda s: None)
    tied = variant == "gpt"
    stages = {f"mp_rank_00_{p:03d}" for p in ([0, 1] if tied and stage == 1 else [stage])}
    assert {f.split("/")[-2] for f in files} == stages and len(files) == len(stages)
    assert _layers(names) == {2 * stage, 2 * stage + 1}
    assert names == {t.name for t in rank_tensors([chunk], ParallelState(world_size=1, rank=0))[0]}
    want = reference.state_dict()
    for name, value in chunk.state_dict().items():
        m = _LAYER.match(name)
        key = f"decoder.layers.{2 * stage + int(m.group(1))}.{name[m.end():]}" if m else name
        key = "embedding.word_embeddings.weight" if tied and key == "output_layer.weight" else key
        rows = VOCAB - 1 if key in VOCAB_TENSORS else None  # the converter re-pads the vocabulary with zeros
        assert torch.equal(value[:rows], want[key][:rows]), name


def test_a_stage_missing_its_tensor_is_reported_as_before(monkeypatch, saved):
    """A tensor the rank needs that is not where its layer says: the whole checkpoint is merged, and
    the report names it as it did."""
    folder, _ = saved["rope_gqa"]
    config = run_config("rope_gqa")
    config.model.add_qkv_bias = True  # a tensor the checkpoint lacks
    chunk = _stage(config, 1)
    files, _ = _spy(monkeypatch)
    with pytest.raises(pretrained.CheckpointError, match="missing in the checkpoint: decoder.layers.2.self_attention"):
        pretrained._load_merged(folder, [chunk], config, ParallelState(world_size=1, rank=0), None, lambda s: None)
    assert {f.split("/")[-2] for f in files} == {"mp_rank_00_000", "mp_rank_00_001"}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_upcycling_merges_only_the_stage_and_builds_only_its_experts(monkeypatch, tmp_path, fmt):
    monkeypatch.setitem(VARIANTS, "dense", VARIANTS["moe"])
    save_model("dense", str(tmp_path / "one"), ckpt_format=fmt)
    folder = tmp_path / "one"
    if fmt == "torch":
        folder = tmp_path / "pp2"
        assert convert("GPT", "--load-dir", tmp_path / "one", "--save-dir", folder,
                       "--target-pipeline-parallel-size", "2") == 0
    config = run_config("moe")
    config.moe = MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_grouped_gemm=True,
                           moe_use_upcycling=True)
    state = ParallelState(world_size=1, rank=0)
    chunk = GPTModel(TransformerConfig.from_model(config.model, **moe_fields(config.moe)), state,
                     pre_process=False, post_process=True, layer_start=2, layer_end=4)
    files, names = [], set()
    merge = upcycle.merge_for_rank

    def spy(*args, **kwargs):
        out = merge(*args, **kwargs)
        names.update(out[0])
        return out

    read = merge_module.read_model_file
    monkeypatch.setattr(merge_module, "read_model_file", lambda path: files.append(path) or read(path))
    monkeypatch.setattr(upcycle, "merge_for_rank", spy)
    upcycle.upcycle_here([chunk], None, str(folder), config, state)
    mlps = {f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for i in (2, 3) for j in (1, 2)}
    # torch_dist: the rest is read from the boxes it needs, only the experts' dense MLPs are merged
    assert names == (mlps if fmt == "torch_dist" else mlps | {n for n in names if ".mlp." not in n})
    assert _layers(names) == {2, 3} and (fmt == "torch_dist" or "embedding.word_embeddings.weight" in names)
    assert {f.split("/")[-2] for f in files} == ({"mp_rank_00_000", "mp_rank_00_001"} if fmt == "torch" else set())
    dense = build_model("dense").state_dict()
    for key, value in chunk.state_dict().items():
        if ".mlp." in key:
            continue  # the experts, below; the routers keep their fresh initialisation
        m = _LAYER.match(key)
        want = dense["embedding.word_embeddings.weight" if key == "output_layer.weight" else
                     f"decoder.layers.{2 + int(m.group(1))}.{key[m.end():]}" if m else key]
        assert torch.equal(value[:VOCAB - 1], want[:VOCAB - 1]), key
    weight1 = chunk.state_dict()["decoder.layers.0.mlp.experts.weight1"]
    assert torch.equal(weight1[3], dense["decoder.layers.2.mlp.linear_fc1.weight"].t())

    # a rank holding experts 2 and 3 of 4: only its two rows are stacked
    source = upcycle._Upcycled("dense", {k: dense[k] for k in ("decoder.layers.2.mlp.linear_fc1.weight",
                                                              "decoder.layers.2.mlp.linear_fc2.weight")}, config.moe)
    name = "decoder.layers.2.mlp.experts.weight1"
    mine = RankTensor(name, torch.zeros(2, 32, 96), None, (2, 32, 96), (2, 0, 0), (4, 32, 96), True, True)
    placed = source.own_rows(mine)
    assert placed.offset == (0, 0, 0) and placed.global_shape == (2, 32, 96)
    assert torch.equal(source[name], dense["decoder.layers.2.mlp.linear_fc1.weight"].t().expand(2, 32, 96))


@pytest.mark.parametrize("layout", [
    ["--target-expert-parallel-size", "2"],
    ["--target-expert-parallel-size", "2", "--target-expert-tensor-parallel-size", "2"],  # a folded expert grid
    ["--target-expert-parallel-size", "2", "--target-pipeline-parallel-size", "2",
     "--target-num-layers-per-virtual-pipeline-stage", "1"],  # stage 1 holds layers 1 and 3
], ids=["ep2", "folded", "pp2_vpp_ep2"])
def test_kept_experts_are_the_whole_merges(monkeypatch, tmp_path, layout):
    """merge_checkpoint(keep=) of an EP2 checkpoint: each kept expert is the one of that number in the
    whole merge (local experts renumbered by the saved experts per rank, not by the ones kept), and only
    the files of the stage holding them are read."""
    monkeypatch.setitem(MOE, "num_experts", 8)  # 4 per EP rank: some kept sets hold 3 local numbers of 4
    save_model("moe", str(tmp_path / "one"))
    assert convert("GPT", "--load-dir", tmp_path / "one", "--save-dir", tmp_path / "out", *layout) == 0
    whole, _ = merge_module.merge_checkpoint(str(tmp_path / "out"))
    files = []
    read = merge_module.read_model_file
    monkeypatch.setattr(merge_module, "read_model_file", lambda path: files.append(path) or read(path))
    for experts in ((1,), (4, 5, 6, 7), (1, 3, 6)):
        wanted = {k for k in whole if re.search(rf"layers\.1\.mlp\.experts\.local_experts\.({'|'.join(map(str, experts))})\.", k)}
        part, _ = merge_module.merge_checkpoint(str(tmp_path / "out"), keep=wanted.__contains__)
        assert set(part) == wanted and all(torch.equal(part[k], whole[k]) for k in wanted)
    stages = {f.split("/")[-2].split("_")[3] for f in files}
    assert stages == ({"001"} if "--target-pipeline-parallel-size" in layout else {"000"})
