"""pretrain_gpt.py --sft through its command line: parallel runs reproduce the single-process run,
the logged loss is Megatron's, and every bad conversation is one line naming file:line (exit 2).

The data: random ChatML conversations over a word-level tokenizer (tests/sft_helpers.py), packed
(--sft-pack-sequences), so every sample has several conversations and the document mask is live
in each parallel kind (under CP the ids travel with the keys around the ring).
"""

import json

import pytest
import torch

import pretrain_gpt
from megatron_lite.data.samplers import collate
from megatron_lite.data.sft_dataset import build_sft_datasets, sft_config_from
from tests.e2e.test_pretrain_gpt import _one_line_exit_2
from tests.e2e.test_pretrain_gpt_cp import run_cli_validation
from tests.harness import run_ranks
from tests.sft_helpers import CHATML, write_conversations, write_tokenizer
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

ITERS = 5  # past the 2 warm-up steps (was 6: one step fewer in every run of the file)


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sftdata")
    return {"tokenizer": write_tokenizer(root / "tok", CHATML),
            "data": write_conversations(root / "chats.jsonl", 64, seed=2, max_turns=2, max_words=3)}


def sft_run_argv(files, data=None, iters=ITERS, pack=True):
    """The SFT data and run flags (no model flags)."""
    return ["--sft"] + (["--sft-pack-sequences"] if pack else []) + [
        "--data-path", data or files["data"], "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", files["tokenizer"], "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0",
        "--split", "100,0,0", "--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "7"]


SFT_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--make-vocab-size-divisible-by",
             "16"]


def sft_argv(files, save=None, extra=(), data=None, iters=ITERS, pack=True):
    return SFT_MODEL + sft_run_argv(files, data, iters, pack) + (["--save", save] if save else []) + list(extra)


@pytest.fixture(scope="module")
def reference(sft_files):
    return run_script("pretrain_gpt", sft_argv(sft_files))


@pytest.mark.parametrize("name, world, extra", [
    ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
    ("cp2", 2, ["--context-parallel-size", "2"]),
    ("dp2", 2, []),
    # the packed documents' ids split over CP and their tokens over TP + SP
    ("cp2_tp2_sp", 4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2_interleaved", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
])
def test_sft_parallel_runs_reproduce_single_process(sft_files, reference, name, world, extra):
    got = ranks_trajectory(world, "pretrain_gpt", sft_argv(sft_files, extra=extra))
    assert_same_trajectory(got, reference, what=name)
    assert reference.losses[-1] < reference.losses[0]  # it trained


def test_lora_on_packed_conversations_reproduces_one_process(tmp_path, sft_files):
    """LoRA fine-tuning on packed chat data (the usual adapter run): TP2 + SP and CP2 give the
    one-process trajectory; the base is pretrained on mock tokens over the tokenizer's 38 ids."""
    base = str(tmp_path / "base")
    pretrain_gpt.main(SFT_MODEL + ["--mock-data", "--vocab-size", "38", "--seq-length", "32", "--micro-batch-size", "2",
                                   "--global-batch-size", "8", "--train-iters", "2", "--eval-iters", "0", "--save", base])
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--pretrained-checkpoint", base]
    reference = run_script("pretrain_gpt", sft_argv(sft_files, extra=lora))
    for name, layout in (("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                         ("cp2", ["--context-parallel-size", "2"])):
        got = ranks_trajectory(2, "pretrain_gpt", sft_argv(sft_files, extra=lora + layout))
        assert_same_trajectory(got, reference, what=f"LoRA SFT {name}")
    assert reference.losses[-1] < reference.losses[0]


def test_per_token_loss_under_fp16_loss_scaling_follows_fp32(sft_files):
    """The loss scale multiplies the (large) token-loss sum before backward and is divided out
    before the per-token division's result is clipped: an fp16 run's first steps follow fp32
    (fp16 rounding: 2e-2), none skipped."""
    argv = sft_argv(sft_files, extra=["--calculate-per-token-loss"], iters=2)
    fp32 = run_script("pretrain_gpt", argv)
    fp16 = run_script("pretrain_gpt", argv + ["--fp16", "--initial-loss-scale", "4096"])  # no overflow to skip
    assert fp16.losses == pytest.approx(fp32.losses, rel=2e-2)
    assert fp16.grad_norms == pytest.approx(fp32.grad_norms, rel=2e-2)


PER_TOKEN = ["--calculate-per-token-loss"]


@pytest.fixture(scope="module")
def per_token_reference(sft_files):
    return run_script("pretrain_gpt", sft_argv(sft_files, extra=PER_TOKEN))


@pytest.mark.parametrize("name, extra", [
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ("pp2_zb_h1", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]),
    ("cp2", ["--context-parallel-size", "2"]),
    ("dp2_zero2", ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads"]),
])
def test_per_token_loss_parallel_runs_reproduce_single_process(sft_files, per_token_reference, reference, name, extra):
    """Every rank divides by the token count of the whole global batch: the last stage's, summed over
    DP x CP, sent to the first stage (its gradients too); and ZeRO-2's gradient shards are scaled."""
    got = ranks_trajectory(2, "pretrain_gpt", sft_argv(sft_files, extra=extra + PER_TOKEN))
    assert_same_trajectory(got, per_token_reference, what=name)
    assert per_token_reference.losses[0] != pytest.approx(reference.losses[0], rel=1e-5)  # the flag changes the loss


def test_per_token_validation_losses_at_pp2_and_cp2_tp2_sp_equal_one_process(sft_files):
    """Validation under --calculate-per-token-loss divides all its token losses by all its tokens:
    summed over the pipeline's micro-batches, DP and CP ranks alike, so each layout logs the
    one-process value at every evaluation."""
    evaluation = PER_TOKEN + ["--eval-interval", "2", "--eval-iters", "2", "--split", "80,20,0"]
    single = pretrain_gpt.main(sft_argv(sft_files, extra=evaluation, iters=4)).validation
    assert [it for it, _ in single] == [2, 4]
    for world, layout in ((2, ["--pipeline-model-parallel-size", "2"]),
                          (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        records = [r for r in run_ranks(world, run_cli_validation, sft_argv(sft_files, extra=evaluation + layout, iters=4))
                   if r]
        assert records and all(r == records[0] for r in records), records
        for (it, value), (it_ref, ref) in zip(records[0], single, strict=True):
            assert it == it_ref and abs(value - ref) <= 1e-5 * abs(ref), (layout, it, value, ref)


def test_logged_loss_is_the_mean_of_the_micro_batch_means(sft_files):
    """Megatron's --sft logging: each micro-batch's loss is its token mean, the logged loss their
    mean (here two micro-batches of one step, lr 0 so the weights stay those the step saw; padded
    samples, so the micro-batches count different numbers of learned tokens)."""
    argv = sft_argv(sft_files, extra=["--lr", "0", "--micro-batch-size", "1", "--global-batch-size", "2"], iters=1,
                    pack=False)
    result = pretrain_gpt.main(argv)
    config = pretrain_gpt.parse_args(argv)
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    train, _, _ = build_sft_datasets(sft_config_from(config, tokenizer), [2, 0, 0], tokenizer)
    model = result.chunks[0]
    sums, counts = [], []
    with torch.no_grad():
        for batch in (collate([train[0]]), collate([train[1]])):
            out, _ = pretrain_gpt.forward_step(iter([batch]), model)
            sums.append(float((out * batch["loss_mask"]).sum()))
            counts.append(float(batch["loss_mask"].sum()))
    micro_mean = sum(s / c for s, c in zip(sums, counts)) / 2
    assert result.losses[0] == pytest.approx(micro_mean, rel=1e-6) and counts[0] != counts[1]
    assert sum(sums) / sum(counts) != pytest.approx(micro_mean, rel=1e-5)  # not the global token mean


def test_per_token_loss_is_the_global_token_mean_and_so_is_its_gradient(sft_files):
    """--calculate-per-token-loss: the logged loss is sum of token losses / loss tokens over both
    micro-batches (padded samples: they count different numbers of tokens; lr 0 so the weights stay
    those the step saw), and the step's gradient norm is the norm of that loss's gradient, computed
    here with plain autograd (the norm is taken before clipping)."""
    argv = sft_argv(sft_files, extra=["--lr", "0", "--micro-batch-size", "1", "--global-batch-size", "2",
                                      "--calculate-per-token-loss"], iters=1, pack=False)
    result = pretrain_gpt.main(argv)
    config = pretrain_gpt.parse_args(argv)
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    train, _, _ = build_sft_datasets(sft_config_from(config, tokenizer), [2, 0, 0], tokenizer)
    model = result.chunks[0]
    batches = [collate([train[0]]), collate([train[1]])]
    counts = [float(b["loss_mask"].sum()) for b in batches]
    sums = [(pretrain_gpt.forward_step(iter([b]), model)[0] * b["loss_mask"]).sum() for b in batches]
    assert counts[0] != counts[1]
    assert result.losses[0] == pytest.approx(float(sum(sums).detach()) / sum(counts), rel=1e-6)
    micro_mean = sum(float(s.detach()) / c for s, c in zip(sums, counts)) / 2
    assert result.losses[0] != pytest.approx(micro_mean, rel=1e-5)  # not what the run logs without the flag
    result.optimizer.zero_grad()  # the hand gradient: the plain backward of that loss, accumulated by the DDP hooks
    (sum(sums) / sum(counts)).backward()
    model.finish_grad_sync()
    norm = float(torch.stack([p.main_grad.double().norm() for p in model.params]).norm())
    assert result.grad_norms[0] == pytest.approx(norm, rel=1e-5)


GOOD = [{"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "sun"}]},
        {"prompt": "how", "response": "moon"}]
BAD = [
    ('{"messages": [{"role": "bot", "content": "x"}]}', "unknown role 'bot'"),
    ('{"messages": [{"role": "assistant", "content": "yes"}]}', "must follow a user turn"),
    ('{"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": " "}]}', "empty assistant turn"),
    ('{"messages": [{"role": "user", "content": "why"}]}', "no assistant turn"),
    ('{"prompt": "' + " ".join(["one"] * 40) + '", "response": "two"}', "longer than --seq-length 32"),
    ('{"messages": [{"role": "user"', "not valid JSON"),
    ('{"text": "one two"}', 'expected {"messages"'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}', "system message"),
]


@pytest.mark.parametrize("line, words", BAD, ids=[w.split()[0] + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_conversation_is_one_line_naming_file_and_line(tmp_path, capsys, sft_files, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(g) + "\n" for g in GOOD) + "\n" + line + "\n")
    _one_line_exit_2(capsys, sft_argv(sft_files, data=str(path), iters=1), f"{path}:4: ", words,
                     "--sft-skip-bad-conversations")


def test_bad_conversations_are_skipped_and_counted_under_the_flag(tmp_path, capsys, sft_files):
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(line + "\n" + json.dumps(GOOD[i % 2]) + "\n" for i, (line, _) in enumerate(BAD)))
    result = pretrain_gpt.main(sft_argv(sft_files, data=str(path), iters=1,
                                        extra=["--sft-skip-bad-conversations", "--global-batch-size", "2"]))
    assert len(result.losses) == 1
    out = capsys.readouterr().out
    assert f"skipped 8 of 16 conversations in {path} (" in out and "1 unknown role" in out


@pytest.mark.parametrize("flags, words", [
    (["--sft-pack-sequences"], ["--sft-pack-sequences needs --sft"]),
    (["--sft", "--mock-data", "--vocab-size", "64"], ["--sft", "not --mock-data"]),
    (["--sft", "--reset-attention-mask", "--data-path", "x.jsonl", "--tokenizer-type", "GPT2BPETokenizer"],
     ["drop --reset-attention-mask"]),
    # docs/fine-tuning.md: --sft refuses NullTokenizer, --eod-mask-loss, --reset-position-ids too
    (["--sft-skip-bad-conversations"], ["--sft-skip-bad-conversations needs --sft"]),
    (["--sft", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--data-path", "x.jsonl"],
     ["needs a text tokenizer", "not --mock-data or NullTokenizer"]),
    (["--sft", "--eod-mask-loss", "--data-path", "x.jsonl", "--tokenizer-type", "GPT2BPETokenizer"],
     ["drop --eod-mask-loss ("]),
    (["--sft", "--reset-position-ids", "--data-path", "x.jsonl", "--tokenizer-type", "GPT2BPETokenizer"],
     ["drop --reset-position-ids ("]),
    # multi-token prediction shifts whole samples: its targets would cross the packed conversations
    (["--sft", "--sft-pack-sequences", "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--data-path",
      "x.jsonl", "--tokenizer-type", "GPT2BPETokenizer"],
     ["--mtp-num-layers with --sft-pack-sequences is not built", "drop one of them"]),
])
def test_sft_flag_errors(capsys, flags, words):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
    if "--sft" not in flags:
        base += ["--mock-data", "--vocab-size", "64"]
    _one_line_exit_2(capsys, base + flags, *words)


def test_sft_is_refused_by_pretrain_bert(capsys):
    import pretrain_bert

    with pytest.raises(SystemExit) as err:
        pretrain_bert.main(["--sft", "--data-path", "x.jsonl", "--tokenizer-type", "BertWordPieceLowerCase",
                            "--vocab-file", "v.txt"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--sft is for pretrain_gpt.py" in lines[0]


def test_split_without_train_weight_is_one_line(capsys, sft_files):
    """--split 0,100,0 gives no train split: one line naming --split (exit 2), not a TypeError from
    next(None) in the first forward step (the same for pretraining data, which shares the iterators)."""
    argv = sft_argv(sft_files, iters=1, extra=["--split", "0,100,0"])
    _one_line_exit_2(capsys, argv, "--split 0,100,0", "the train split has weight 0", "--train-iters 1")


@pytest.mark.parametrize("name, text", [
    ("chats.json", json.dumps(GOOD * 4, indent=2)),  # pretty-printed: line 1 is "["
    ("chats.jsonl", json.dumps(GOOD * 4)),  # the whole array on one line
], ids=["pretty_printed", "one_line"])
def test_json_array_file_says_jsonl_is_expected_and_how_to_convert(tmp_path, capsys, sft_files, name, text):
    """A JSON array of conversations was 'line 1: not valid JSON' (pretty-printed) or 'expected
    {"messages": ...}' (one line), with no hint that one conversation per line is expected; also
    under --sft-skip-bad-conversations and in tools/preprocess_sft.py. The command it prints converts
    the file into one that trains."""
    import shlex
    import subprocess
    import sys

    from tests.tools import load_tool

    path = tmp_path / name
    path.write_text(text + "\n")
    words = [f"{path}: line 1 starts a JSON array", "JSONL (one conversation per line)", "jq -c '.[]'"]
    _one_line_exit_2(capsys, sft_argv(sft_files, data=str(path), iters=1), *words)
    _one_line_exit_2(capsys, sft_argv(sft_files, data=str(path), iters=1, extra=["--sft-skip-bad-conversations"]),
                     *words)
    code = load_tool("preprocess_sft").main(["--input", str(path), "--output-prefix", str(tmp_path / "out"),
                                             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                             sft_files["tokenizer"], "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words[0] in err and "(--input)" in err, err
    python = err.split("(or ")[1].split(") and pass")[0]  # the python one-liner (no jq needed)
    argv = shlex.split(python.split(" < ")[0])
    argv[0] = sys.executable
    out = python.split(" > ")[-1]
    with open(path, "rb") as src, open(out, "wb") as dst:
        subprocess.run(argv, stdin=src, stdout=dst, check=True)
    assert [json.loads(line) for line in open(out)] == GOOD * 4
    assert len(pretrain_gpt.main(sft_argv(sft_files, data=out, iters=1, extra=["--global-batch-size", "2"])).losses) == 1


def test_sft_run_ends_with_the_test_split_pass_equal_to_an_independent_evaluation(sft_files, capsys):
    """--sft with a test weight in --split: the run that trains to --train-iters ends with the test
    pass (it was skipped: the provider built no SFT test split), and its loss is the mean of the
    micro-batch means of the test split's first global batch, evaluated here by hand on the final model."""
    argv = sft_argv(sft_files, extra=["--split", "60,20,20", "--eval-iters", "1"], iters=2, pack=False)
    result = pretrain_gpt.main(argv)
    assert "validation loss at iteration 2 on test set | lm loss value:" in capsys.readouterr().out
    (got,) = [value["lm loss"] for it, name, value in result.evaluations if name == "test"]
    config = pretrain_gpt.parse_args(argv)
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    _, _, test = build_sft_datasets(sft_config_from(config, tokenizer), [0, 0, 8], tokenizer)
    _, valid, _ = build_sft_datasets(sft_config_from(config, tokenizer), [0, 8, 0], tokenizer)
    model = result.chunks[0].eval()
    with torch.no_grad():
        def loss_of(batch):
            out, _ = pretrain_gpt.forward_step(iter([batch]), model)
            return float((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
        means = [loss_of(collate([test[i], test[i + 1]])) for i in range(0, 8, 2)]
        other = loss_of(collate([valid[0], valid[1]]))
    assert got == pytest.approx(sum(means) / 4, rel=1e-6)
    assert other != pytest.approx(means[0], rel=1e-3)  # the test split is its own conversations, not the validation's
