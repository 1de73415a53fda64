"""The sharded checkpoint format (--ckpt-format torch_dist): a checkpoint saved at TP2 x DP2 with the
distributed optimizer resumes at TP1 x DP4 and at PP2 on the single-process run's trajectory, with its optimizer
state resharded bit for bit; each rank writes only its own pieces; --auto-detect-ckpt-format;
damaged checkpoints are one-line errors (every saved piece has a CRC-32, verified at any layout); a
checkpoint saved before checksums still loads. --async-save: test_torch_dist_async.py."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import megatron_lite.training.loop as loop
import pretrain_gpt
from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint, save_checkpoint
from megatron_lite.checkpoint.dist_read import merge_dist_optimizer, read_index
from tests.e2e.test_pretrain_gpt import MODEL, MODEL_B, _argv, _one_line_exit_2
from tests.harness import run_ranks
from tests.tools import load_tool
from tests.trajectory import (
    Trajectory,
    assert_same_trajectory,
    ranks_trajectories,
    ranks_trajectory,
    run_script,
)

DIST = ["--ckpt-format", "torch_dist"]
# 124 vocabulary rows (123 + end of document) pad to 140 at TP2 and to 130 at TP1: resuming at another
# TP size re-pads the vocabulary tensors and their optimizer state
REPAD = ["--make-vocab-size-divisible-by", "10"]
REAL_ROWS = 124
TP2 = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
TP1 = ["--use-distributed-optimizer", "--no-load-rng"]
PP2 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--no-load-rng"]


def resave_then_continue(resave_argv, resave_dir, continue_argv):
    """In a rank: load the checkpoint at this layout and save it again at once (no step; skipped
    when ``resave_dir`` is None), then train on."""
    if resave_dir is None:
        return Trajectory.of(pretrain_gpt.main(continue_argv))
    config = parse_args(resave_argv, world_size=dist.get_world_size())
    pretrain_gpt.set_vocab(config, pretrain_gpt.build_tokenizer_for(config))
    state, device = loop.setup(config)
    built = loop.build_run(config, state, device, pretrain_gpt.model_provider)
    config.checkpoint.save = resave_dir
    save_checkpoint(built.iteration, built.chunks, built.optimizer, built.scheduler, built.consumed_samples, config, state)
    return Trajectory.of(pretrain_gpt.main(continue_argv))


def _continue(tmp_path, src, name, layout, resave=True):
    argv = _argv(str(tmp_path / name), 8, MODEL_B + REPAD + DIST + layout + ["--load", src])
    resaved = str(tmp_path / f"{name}_resaved") if resave else None
    out = run_ranks(4, resave_then_continue, argv, resaved, argv)
    last = [r for r in out if r.losses]
    assert last and all(r == last[0] for r in last) and all(r.grad_norms == last[0].grad_norms for r in out)
    return last[0], resaved


def _same_tables(a, b, rows=None):
    """Equal bit for bit (vocabulary tensors on their first ``rows`` rows when given)."""
    assert a.keys() == b.keys()
    for name in a:
        n = rows if name in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(a[name][:n], b[name][:n]), name


def _check_ownership(src):
    """Every element of every tensor is stored once; weights only by DP rank 0 (ranks 0 and 1: TP is
    innermost), each TP shard by its own TP rank; the optimizer's moments spread over all four ranks."""
    folder = os.path.join(src, "iter_0000004")
    index = read_index(folder)
    from torch.distributed.checkpoint import FileSystemReader
    storage = FileSystemReader(folder).read_metadata().storage_data
    file_of = {meta.fqn: info.relative_path for meta, info in storage.items()}
    moments = {}
    for (kind, name), boxes in index.items():
        ext = [max(o[i] + s[i] for o, s, _, _ in boxes) for i in range(len(boxes[0][0]))]
        assert sum(torch.Size(s).numel() for _, s, _, _ in boxes) == torch.Size(ext).numel(), (kind, name)
        for offset, size, _, key in boxes:
            rank = int(file_of[key].split("_")[2])
            if kind == "weight":
                assert rank in (0, 1), key
                split = [i for i, (s, e) in enumerate(zip(size, ext)) if s != e]
                assert (not split and rank == 0) or (split and offset[split[0]] // size[split[0]] == rank), key
            if kind == "exp_avg":
                moments[rank] = moments.get(rank, 0) + torch.Size(size).numel()
    total = sum(moments.values())
    assert sorted(moments) == [0, 1, 2, 3] and all(0.2 < n / total < 0.3 for n in moments.values()), moments


def _repadded(table, padded):
    """Every vocabulary tensor of ``table`` has ``padded`` rows, zero beyond the real vocabulary."""
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert table[name].shape[0] == padded and not table[name][REAL_ROWS:].any(), name


@pytest.fixture(scope="module")
def tp2_src(tmp_path_factory):
    """A checkpoint saved at TP2 x DP2 with the distributed optimizer after 4 steps (vocabulary padded
    to 140); read only (a test that damages it works on a copy)."""
    src = str(tmp_path_factory.mktemp("tp2") / "src")
    first = ranks_trajectory(4, "pretrain_gpt", _argv(src, 8, MODEL_B + REPAD + DIST + TP2 + ["--exit-interval", "4"]))
    assert len(first.losses) == 4
    return src


def test_torch_dist_resumes_at_another_layout_with_its_optimizer_state(tmp_path, tp2_src):
    """Saved at TP2 x DP2 (vocabulary padded to 140), resumed at TP1 x DP4 (130) and PP2 (130):
    the same trajectory as resuming at TP2, the optimizer state equal on the real rows, and the
    padded rows of weights and state zero, as the converter writes them."""
    src = tp2_src
    same, _ = _continue(tmp_path, src, "same", TP2, resave=False)
    _check_ownership(src)
    for name, layout in (("tp1_dp4", TP1), ("pp2", PP2)):
        trajectory, resaved = _continue(tmp_path, src, name, layout)
        assert_same_trajectory(trajectory, same, steps=4, what=name)
        want, got = merge_dist_optimizer(src), merge_dist_optimizer(resaved)
        _same_tables(got["masters"], want["masters"], rows=REAL_ROWS)
        for key in want["state"]:
            _same_tables(got["state"][key], want["state"][key], rows=REAL_ROWS)
            _repadded(got["state"][key], 130)
        assert got["scalars"] == want["scalars"] and got["group"] == want["group"] and got["scheduler"] == want["scheduler"]
        _same_tables(merge_checkpoint(resaved)[0], merge_checkpoint(src)[0], rows=REAL_ROWS)
        _repadded(merge_checkpoint(resaved)[0], 130)
    # the converter reads torch_dist too: to a torch checkpoint at TP1 (re-padded) with the same
    # weights and optimizer state, which resumes on the same trajectory
    out = str(tmp_path / "converted")
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--load-dir", src, "--save-dir", out,
                                                 "--target-tensor-parallel-size", "1"]) == 0
    _same_tables(merge_checkpoint(out)[0], merge_checkpoint(src)[0], rows=REAL_ROWS)
    _repadded(merge_checkpoint(out)[0], 130)
    converted = pretrain_gpt.main(_argv(str(tmp_path / "from_converted"), 8, MODEL_B + REPAD + TP1 + ["--load", out]))
    assert_same_trajectory(Trajectory.of(converted), same, steps=4, what="converted to TP1")


def test_torch_dist_saved_in_one_process_resumes_at_tp2_with_more_padding(tmp_path):
    """The other direction: saved in one process (130 vocabulary rows), resumed at TP2 (140): the
    added rows are zero in the weights and the optimizer state, the trajectory is the one-process one."""
    src = str(tmp_path / "src")
    one = MODEL_B + REPAD + DIST + ["--use-distributed-optimizer"]
    pretrain_gpt.main(_argv(src, 8, one + ["--exit-interval", "4"]))
    same = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "same"), 8, one + ["--load", src])))
    argv = _argv(str(tmp_path / "tp2"), 8, one + ["--load", src, "--tensor-model-parallel-size", "2", "--no-load-rng"])
    resaved = str(tmp_path / "resaved")
    tp2 = [r for r in run_ranks(2, resave_then_continue, argv, resaved, argv) if r.losses][0]
    assert_same_trajectory(tp2, same, steps=4, what="tp2")
    want, got = merge_dist_optimizer(src), merge_dist_optimizer(resaved)
    for key in want["state"]:
        _same_tables(got["state"][key], want["state"][key], rows=REAL_ROWS)
        _repadded(got["state"][key], 140)
    _same_tables(got["masters"], want["masters"], rows=REAL_ROWS)
    _same_tables(merge_checkpoint(resaved)[0], merge_checkpoint(src)[0], rows=REAL_ROWS)
    _repadded(merge_checkpoint(resaved)[0], 140)


def test_tied_model_saved_in_one_process_resumes_at_pp2(tmp_path):
    """The last stage's copy of a tied embedding (never saved) and its optimizer state come from the
    embedding's pieces."""
    src = str(tmp_path / "src")
    pretrain_gpt.main(_argv(src, 6, MODEL + DIST + ["--exit-interval", "2"]))
    same = run_script("pretrain_gpt", _argv(str(tmp_path / "same"), 6, MODEL + DIST + ["--load", src]))
    pp2 = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "pp2"), 6, MODEL + DIST + [
        "--load", src, "--pipeline-model-parallel-size", "2", "--no-load-rng"]))
    assert_same_trajectory(pp2, same, steps=4)


@pytest.fixture(scope="module")
def single6(tmp_path_factory):
    """The uninterrupted single-process run of MODEL: 6 steps."""
    return run_script("pretrain_gpt", _argv(str(tmp_path_factory.mktemp("single6") / "s"), 6, MODEL))


def test_auto_detect_ckpt_format(tmp_path, capsys):
    torch_ckpt = str(tmp_path / "torch")
    pretrain_gpt.main(_argv(torch_ckpt, 6, ["--exit-interval", "2"]))
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 6, DIST + ["--load", torch_ckpt]),
                     "is in the torch format", "--auto-detect-ckpt-format")
    resumed = pretrain_gpt.main(_argv(str(tmp_path / "d"), 6, DIST + ["--load", torch_ckpt, "--auto-detect-ckpt-format",
                                                                     "--exit-interval", "3"]))
    assert resumed.iteration == 3 and len(resumed.losses) == 1
    assert load_gpt_checkpoint(str(tmp_path / "d"))[1]["iteration"] == 3  # tools/generate.py's reader
    back = pretrain_gpt.main(_argv(str(tmp_path / "t"), 6, ["--load", str(tmp_path / "d"), "--auto-detect-ckpt-format",
                                                           "--exit-interval", "4"]))
    assert back.iteration == 4 and len(back.losses) == 1


def _every_key_checksummed(folder):
    index = read_index(folder)
    keys = {key for boxes in index.values() for *_, key in boxes}
    assert keys and set(index.checksums) == keys


def _flip(folder, key, where=None):
    """Flip one byte of the stored bytes of DCP key ``key`` (its middle, or ``where`` bytes into its
    record: 0 is the record's zip header), found from ``.metadata``; the data file's path."""
    from torch.distributed.checkpoint import FileSystemReader

    [info] = [f for i, f in FileSystemReader(folder).read_metadata().storage_data.items() if i.fqn == key]
    data = os.path.join(folder, info.relative_path)
    with open(data, "r+b") as f:
        f.seek(info.offset + (info.length // 2 if where is None else where))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return data


def test_damaged_or_foreign_torch_dist_checkpoints_are_one_line_errors(tmp_path, capsys):
    save = str(tmp_path / "s")
    pretrain_gpt.main(_argv(save, 6, MODEL + DIST + ["--exit-interval", "2"]))
    folder = os.path.join(save, "iter_0000002")
    load = _argv(str(tmp_path / "x"), 6, MODEL + DIST + ["--load", save])
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 6, MODEL + DIST + ["--load", save, "--hidden-size", "64"]),
                     "--hidden-size 32 (this run 64)", "load it with --hidden-size 32")
    key = "weight/embedding.word_embeddings.weight/0_0_0"
    data = _flip(folder, key, where=0)  # the record's header: DCP cannot read it
    _one_line_exit_2(capsys, load, data, "could not be read", "corrupt")
    _flip(folder, key, where=0)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)  # named with its size before DCP reads anything
    _one_line_exit_2(capsys, load, data, "is truncated (", "bytes, its pieces need")
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    _one_line_exit_2(capsys, load, ".metadata", "corrupt")


def test_a_tensor_with_damaged_bytes_is_refused_naming_its_file_and_tensor(tmp_path, capsys):
    """One byte of one saved tensor flipped (the file still reads): its CRC-32 no longer matches."""
    save = str(tmp_path / "s")
    pretrain_gpt.main(_argv(save, 6, MODEL + DIST + ["--exit-interval", "2"]))
    folder = os.path.join(save, "iter_0000002")
    _every_key_checksummed(folder)
    key = "weight/embedding.word_embeddings.weight/0_0_0"
    data = _flip(folder, key)
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 6, MODEL + DIST + ["--load", save]),
                     data, f"tensor {key} fails its checksum")


def test_damage_in_a_tp2_checkpoint_is_refused_when_tp1_reshards_it(tmp_path, capsys, tp2_src):
    """TP1 reads both TP shards of every tensor (each saved piece whole, whatever part it needs): a
    byte flipped in TP rank 1's shard of a weight (file __1_0.distcp), or in DP rank 3's slice of
    Adam's moment (__3_0.distcp), is refused by --load at TP1 and by the converter, naming file and tensor."""
    src = str(tmp_path / "src")
    shutil.copytree(tp2_src, src)
    folder = os.path.join(src, "iter_0000004")
    index = read_index(folder)
    owned = [(kind, key) for (kind, name), boxes in sorted(index.items()) for offset, _, _, key in boxes
             if any(offset) and index.files[key] == {"weight": "__1_0.distcp", "exp_avg": "__3_0.distcp"}.get(kind)]
    load = _argv(str(tmp_path / "x"), 8, MODEL_B + REPAD + DIST + TP1 + ["--load", src])
    convert = load_tool("checkpoint/convert").main
    for kind in ("weight", "exp_avg"):
        key = next(k for c, k in owned if c == kind)
        data = _flip(folder, key)
        assert data.endswith({"weight": "__1_0.distcp", "exp_avg": "__3_0.distcp"}[kind])
        _one_line_exit_2(capsys, load, data, f"tensor {key} fails its checksum")
        assert convert(["--model-type", "GPT", "--load-dir", src, "--save-dir", str(tmp_path / "c")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and data in lines[0] and key in lines[0], lines
        _flip(folder, key)  # undone: the next damage is the only one
    pretrain_gpt.main(load)  # undamaged, it loads


def test_a_checkpoint_saved_before_checksums_loads_with_one_warning(tmp_path, capsys):
    """No checksums/ folder (a checkpoint from before they existed): read unverified, one warning line,
    the same run as from the checksummed copy. A checksums file that lacks a key is damage, and so is a
    newer checkpoint (its common.pt says it had checksums) copied without the folder: refused."""
    save, old, holed = (str(tmp_path / n) for n in ("s", "old", "holed"))
    pretrain_gpt.main(_argv(save, 4, MODEL + DIST + ["--exit-interval", "2"]))
    shutil.copytree(save, old)
    shutil.rmtree(os.path.join(old, "iter_0000002", "checksums"))
    _one_line_exit_2(capsys, _argv(str(tmp_path / "w"), 4, MODEL + DIST + ["--load", old]),
                     os.path.join(old, "iter_0000002"), "saved with checksums", "checksums/ folder is missing")
    common_path = os.path.join(old, "iter_0000002", "common.pt")
    common = torch.load(common_path, weights_only=True)
    del common["piece_checksums"]  # what a checkpoint saved before checksums holds
    torch.save(common, common_path)
    capsys.readouterr()
    resumed = pretrain_gpt.main(_argv(str(tmp_path / "x"), 4, MODEL + DIST + ["--load", old]))
    assert capsys.readouterr().out.count("has no checksums (saved before they existed)") == 1
    assert resumed.iteration == 4
    want = pretrain_gpt.main(_argv(str(tmp_path / "y"), 4, MODEL + DIST + ["--load", save]))
    assert "has no checksums" not in capsys.readouterr().out
    assert_same_trajectory(Trajectory.of(resumed), Trajectory.of(want), rtol=0)
    shutil.copytree(save, holed)
    crcs = os.path.join(holed, "iter_0000002", "checksums", "rank_00000.pt")
    table = torch.load(crcs)
    key = sorted(table["tensor_checksums"])[3]
    del table["tensor_checksums"][key]
    torch.save(table, crcs)
    _one_line_exit_2(capsys, _argv(str(tmp_path / "z"), 4, MODEL + DIST + ["--load", holed]),
                     f"tensor {key}", "has no checksum in checksums/")


@pytest.mark.parametrize("flags, words", [
    (["--async-save"], "--async-save needs --ckpt-format torch_dist"),
])
def test_torch_dist_flag_refusals(capsys, monkeypatch, flags, words):
    monkeypatch.setenv("WORLD_SIZE", "2")  # flags checked for 2 ranks
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2"] + flags, words)


def test_zero3_run_saves_torch_dist_and_resumes_under_the_distributed_optimizer(tmp_path, single6):
    """ZeRO-3 holds only a shard of each weight between uses: a torch_dist save from such a run (with
    its all-gathers overlapped) still writes full pieces, and they resume under plain ZeRO-1 and ZeRO-3
    with the single-process run's losses and gradient norms."""
    zero3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce", "--overlap-param-gather"]
    src = str(tmp_path / "src")
    first = ranks_trajectory(2, "pretrain_gpt", _argv(src, 6, MODEL + DIST + zero3 + ["--exit-interval", "3"]))
    second = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "next"), 6, MODEL + DIST + [
        "--use-distributed-optimizer", "--load", src]))
    again = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "again"), 6, MODEL + DIST + zero3 + ["--load", src]))
    assert_same_trajectory(first + second, single6, steps=6, what="ZeRO-3 then ZeRO-1")
    assert_same_trajectory(first + again, single6, steps=6, what="ZeRO-3 then ZeRO-3")


ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]


@pytest.mark.parametrize("world, flags, resumes", [
    (4, ["--num-distributed-optimizer-instances", "2"], [[]]),
    (2, ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"], [[]]),
    # HSDP: ZeRO-3 sharded in 2 instances of 2; resumed as ZeRO-3 in one instance of 4, and as ZeRO-1
    (4, ZERO3 + ["--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce", "--overlap-param-gather"],
     [ZERO3, []]),
], ids=["hybrid_dp4x2", "offload_half", "hsdp_zero3_dp4x2"])
def test_hybrid_and_offloaded_runs_save_torch_dist_and_resume_without_them(tmp_path, single6, world, flags, resumes):
    """Hybrid sharding (the same optimizer slice on every instance; with ZeRO-3 the same parameter
    shard too) and CPU offload (part of the slice on the host) write the same pieces as the plain
    distributed optimizer: resumed without them, the run follows the single-process one."""
    src = str(tmp_path / "src")
    distopt = ["--use-distributed-optimizer"]
    first = ranks_trajectory(world, "pretrain_gpt", _argv(src, 6, MODEL + DIST + distopt + flags + ["--exit-interval", "3"]))
    argvs = [_argv(str(tmp_path / f"next{i}"), 6, MODEL + DIST + distopt + extra + ["--load", src])
             for i, extra in enumerate(resumes)]
    for extra, second in zip(resumes, ranks_trajectories(world, "pretrain_gpt", argvs)):
        assert_same_trajectory(first + second, single6, steps=6, what=" ".join(extra) or "optim")
