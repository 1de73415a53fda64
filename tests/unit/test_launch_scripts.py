"""The launch scripts in examples/ stay valid: their flags parse and validate for the world size they
are written for (MEGATRON_LITE_CHECK_ARGS=1), and the SLURM script prints and runs the right commands
under a fake SLURM (fake ``scontrol`` and ``srun`` on PATH, SLURM_* variables set by hand).

In check mode a script ends in ``WORLD_SIZE=N exec $PYTHON <entry script> <flags>``: the tests give it
a stand-in ``$PYTHON`` that records what it was handed, then run that command in this process
(:func:`_run_entry`), which spares a Python start-up per script."""

import glob
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time

import pytest

from megatron_lite.arguments import build_parser
from tests.e2e.conftest import ROOT

EXAMPLES = os.path.join(ROOT, "examples")
SBATCH = os.path.join(EXAMPLES, "slurm", "train_gpt.sbatch")

# script -> (world size it is written for, TP, PP, DP)
SCRIPTS = {
    "gpt3/train_gpt3_1.3b.sh": (8, 1, 1, 8),
    "gpt3/train_gpt3_175b.sh": (1024, 8, 16, 8),
    "llama/train_llama3_8b.sh": (8, 2, 1, 4),
    "llama/train_llama3_70b.sh": (64, 8, 4, 2),
    "mixtral/train_mixtral_8x7b.sh": (64, 1, 4, 16),
    "deepseek_v3/train_deepseek_v3_671b.sh": (1024, 2, 16, 32),
    "bert/train_bert_large.sh": (8, 1, 1, 8),
}


def _missing_feature(script: str) -> str | None:
    """Why a script cannot validate yet (its model family has not landed), or None."""
    if "bert" in script and not os.path.exists(os.path.join(ROOT, "pretrain_bert.py")):
        return "pretrain_bert.py does not exist yet"
    if "mixtral" in script and "--num-experts" not in build_parser()._option_string_actions:
        return "the mixture-of-experts flags (--num-experts) do not exist yet"
    return None


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHON=sys.executable)
    env.pop("WORLD_SIZE", None)
    env.update(extra)
    return env


def _bash(path, *args, **env):
    return subprocess.run(["bash", path, *args], cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=120)


def _handed_over(tmp_path, path, **env):
    """Run the launch script ``path`` in check mode with a stand-in interpreter; (WORLD_SIZE, entry
    script, flags) it was handed."""
    record = tmp_path / "handed_over"
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh\nprintf '%s\\0' "$WORLD_SIZE" "$MEGATRON_LITE_CHECK_ARGS" "$@" > {record}\n""")
    python.chmod(0o755)
    out = _bash(path, MEGATRON_LITE_CHECK_ARGS="1", PYTHON=str(python), **env)
    assert out.returncode == 0, out.stderr[-2000:]
    world, check, entry, *flags = record.read_text().split("\0")[:-1]
    assert check == "1"
    return int(world), entry, flags


def _run_entry(monkeypatch, capsys, world, entry, flags):
    """``MEGATRON_LITE_CHECK_ARGS=1 WORLD_SIZE=world python entry flags``, run in this process:
    (exit code, stdout, stderr)."""
    assert os.path.dirname(entry) == ROOT and os.path.isfile(entry), entry
    monkeypatch.setenv("MEGATRON_LITE_CHECK_ARGS", "1")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(sys, "argv", [entry, *flags])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(entry, run_name="__main__")
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def test_every_example_script_is_listed():
    found = {os.path.relpath(os.path.join(d, f), EXAMPLES) for d, _, files in os.walk(EXAMPLES) for f in files
             if f.startswith("train_") and f.endswith(".sh")}
    assert found == set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_script_flags_validate(tmp_path, monkeypatch, capsys, script):
    reason = _missing_feature(script)
    if reason:
        pytest.skip(reason)
    world, tp, pp, dp = SCRIPTS[script]
    handed = _handed_over(tmp_path, os.path.join(EXAMPLES, script))
    assert handed[0] == world
    code, out, err = _run_entry(monkeypatch, capsys, *handed)
    assert code == 0, err[-2000:]
    assert f"arguments valid for world size {world}: TP {tp} x PP {pp} x DP {dp}," in out


def test_sentencepiece_scripts_keep_the_models_vocabulary(tmp_path, tmp_path_factory):
    """A script for a published SentencePiece model (Mixtral: "vocabulary 32000") must use the
    tokenizer that keeps the model's pieces (GPTSentencePieceTokenizer): SentencePieceTokenizer appends
    <CLS> <SEP> <EOD> <MASK> <PAD> (32005 ids) and ends documents with <EOD> instead of the model's </s>,
    a different model from the published one."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from tests.tools import load_tool
    from tests.unit.test_tokenizers import corpus_texts

    prefix = str(tmp_path_factory.mktemp("spm") / "tiny")
    model = load_tool("train_tokenizer").train_sentencepiece(corpus_texts() * 2, prefix, vocab_size=600,
                                                             model_type="bpe")
    checked = 0
    for script in sorted(SCRIPTS):
        _, _, flags = _handed_over(tmp_path, os.path.join(EXAMPLES, script))
        kind = flags[flags.index("--tokenizer-type") + 1]
        if "SentencePiece" in kind:
            tok = build_tokenizer(kind, tokenizer_model=model)
            assert (tok.vocab_size, tok.eod) == (tok.sp.get_piece_size(), tok.sp.eos_id()), (script, kind)
            checked += 1
    assert checked


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_header_describing_all_to_alls_uses_the_alltoall_dispatcher(tmp_path, script):
    """The default --moe-token-dispatcher-type is allgather (Megatron-LM's): a header that promises
    expert parallelism by all-to-alls must ask for them."""
    with open(os.path.join(EXAMPLES, script)) as f:
        header = " ".join(line.lstrip("#").strip() for line in f if line.startswith("#"))
    if "all-to-all" in header and "--num-experts" in open(os.path.join(EXAMPLES, script)).read():
        _, _, flags = _handed_over(tmp_path, os.path.join(EXAMPLES, script))
        assert flags[flags.index("--moe-token-dispatcher-type") + 1] == "alltoall", script


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_header_names_no_existing_flag_as_missing(script):
    """A header that says flags do not exist yet must not name a flag the parser has."""
    with open(os.path.join(EXAMPLES, script)) as f:
        header = " ".join(line.lstrip("#").strip() for line in f if line.startswith("#"))
    flags = set(build_parser()._option_string_actions)
    for sentence in header.split(". "):
        if "exist" in sentence:
            assert not [w for w in re.findall(r"--[a-z0-9-]+", sentence) if w in flags], sentence


# Flags whose value is a path a command writes.
WRITES = ("--save", "--save-dir", "--output", "-o", "--output-prefix", "--tensorboard-dir", "--wandb-save-dir",
          "--data-cache-path", "--png")


def _written_paths(markdown: str):
    """(flag, path) of every output path in the ```bash blocks of ``markdown``."""
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split(" #")[0], comments=True)
            yield from ((w, words[i + 1]) for i, w in enumerate(words[:-1]) if w in WRITES)


def test_readme_commands_write_into_ignored_folders():
    """Following README.md and docs/*.md in a clone leaves `git status` clean: whatever their
    commands write is git-ignored (checkpoints/, hf/, data/, runs/, *.png in the root, ...)."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    written = [(os.path.basename(page), flag, path) for page in pages for flag, path in _written_paths(open(page).read())]
    assert len(written) > 20 and any(flag == "--save-dir" and path.startswith("hf/") for _, flag, path in written)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, capture_output=True, text=True,
                             input="\n".join(path for _, _, path in written)).stdout.split()
    assert [w for w in written if w[2] not in ignored] == []


def test_check_mode_refuses_a_layout_that_does_not_fit(tmp_path, monkeypatch, capsys):
    """3 nodes x 8 = 24 GPUs cannot hold TP 8 x PP 16: exit 2 with the reason, as a real launch would."""
    handed = _handed_over(tmp_path, os.path.join(EXAMPLES, "gpt3/train_gpt3_175b.sh"), NUM_NODES="3")
    assert handed[0] == 24
    code, _, err = _run_entry(monkeypatch, capsys, *handed)
    assert code == 2
    assert "world size 24 is not divisible by --tensor-model-parallel-size 8" in err


def _fake_slurm(tmp_path, srun_rc=0):
    """Fake scontrol/srun on PATH that record their calls in tmp_path/calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f'echo "scontrol $*" >> {calls}\n'
        'if [ "$1 $2" = "show hostnames" ]; then echo gpu-node-07; echo gpu-node-08; fi\n'
    )
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "srun $*" >> {calls}\nexit {srun_rc}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_NAME": "gpt", "SLURM_SUBMIT_DIR": ROOT,
        "RUN_DIR": str(tmp_path / "run"), "TRAIN_ITERS": "10000",
    }
    return env, calls


@pytest.mark.parametrize("env", [{"NODE_RANK": "1"}, {"NODE_RANK": "2", "NUM_NODES": "2"}, {"NUM_NODES": "0"},
                                 {"NUM_NODES": "two"}])
def test_a_node_rank_outside_num_nodes_is_refused(tmp_path, env):
    """NODE_RANK=1 without NUM_NODES (default 1) started a second, independent one-node job on that
    node instead of joining the first: refused in one line, exit 2, in check mode too."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\necho "torchrun $*"\n')
    fake.chmod(0o755)
    for check in ("0", "1"):
        out = _bash(os.path.join(EXAMPLES, "llama/train_llama3_8b.sh"), MEGATRON_LITE_CHECK_ARGS=check,
                    PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", **env)
        assert out.returncode == 2, (out.stdout[-500:], out.stderr[-500:])
        assert "torchrun" not in out.stdout
        [line] = out.stderr.strip().splitlines()
        assert "NODE_RANK" in line and "NUM_NODES" in line, line
    bert = {k.replace("NUM_NODES", "NNODES"): v for k, v in env.items()}  # its own name, NNODES
    out = _bash(os.path.join(EXAMPLES, "pretrain_bert_distributed.sh"), PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
                **bert)
    assert out.returncode == 2 and "torchrun" not in out.stdout and "NNODES" in out.stderr, out.stderr[-500:]


def test_sbatch_dry_run_prints_the_launch(tmp_path, monkeypatch, capsys):
    env, calls = _fake_slurm(tmp_path)
    env["SLURM_CPUS_PER_TASK"] = "64"  # set by sbatch from #SBATCH --cpus-per-task=64
    out = _bash(SBATCH, "--dry-run", **env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in lines
    assert not (tmp_path / "run").exists()  # the dry run created nothing
    assert not os.path.exists(calls) or "srun" not in calls.read_text()
    [launch] = [shlex.split(line) for line in lines if line.startswith("srun ")]
    entry = launch.index(os.path.join(ROOT, "pretrain_gpt.py"))
    torchrun = launch[:entry]
    # --cpus-per-task passed on: srun does not inherit it since SLURM 22.05 (1 CPU for all 8 workers)
    assert torchrun[:4] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=64"]
    rdzv = " ".join(torchrun[4:])
    assert rdzv.startswith("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id 4242 --rdzv-backend c10d "
                           "--rdzv-endpoint gpu-node-07:29500 ")
    flags = launch[entry + 1:]
    ckpt = str(tmp_path / "run" / "checkpoints")
    for flag, value in (("--save", ckpt), ("--load", ckpt), ("--train-iters", "10000")):
        assert flags[flags.index(flag) + 1] == value
    assert "--exit-signal-handler" in flags
    assert lines[-1] == "scontrol requeue 4242"
    # the printed flags are valid for 2 nodes x 8 GPUs
    code, stdout, stderr = _run_entry(monkeypatch, capsys, 16, launch[entry], flags)
    assert code == 0, stderr
    assert "arguments valid for world size 16: TP 2 x PP 1 x DP 8" in stdout


def test_sbatch_output_folder_exists_in_a_clone():
    """SLURM does not create the folder of #SBATCH --output; a job whose output file cannot be opened
    fails at once (exit 0:53). The script is submitted from the repository root, so the folder must be
    in a fresh clone (tracked), and what the jobs write there ignored."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    with open(SBATCH) as f:
        [output] = [line.split("=", 1)[1].split()[0] for line in f if line.startswith("#SBATCH --output=")]
    folder = os.path.dirname(output)
    if folder:
        tracked = subprocess.run(["git", "ls-files", "--", folder], cwd=ROOT, capture_output=True, text=True).stdout
        assert tracked.strip(), f"{folder}/ is not in the repository: sbatch from a fresh clone fails"
        log = os.path.join(folder, "megatron-lite-gpt-4242.out")
        assert subprocess.run(["git", "check-ignore", "--no-index", "-q", log], cwd=ROOT).returncode == 0


def test_sbatch_outside_slurm_is_refused():
    out = _bash(SBATCH, "--dry-run", SLURM_JOB_ID="")
    assert out.returncode != 0
    assert "not inside a SLURM allocation" in out.stderr


@pytest.mark.parametrize("latest, srun_rc, requeued", [(400, 0, True), (10000, 0, False), (400, 1, False)])
def test_sbatch_requeues_only_after_a_clean_early_exit(tmp_path, latest, srun_rc, requeued):
    """Exit 0 before the last iteration = stopped by the signal handler: requeue. Finished, or
    crashed (non-zero exit): do not."""
    env, calls = _fake_slurm(tmp_path, srun_rc)
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{latest}\n")
    out = _bash(SBATCH, **env)
    assert out.returncode == srun_rc, out.stderr
    recorded = calls.read_text().splitlines()
    assert sum(line.startswith("srun --ntasks-per-node=1") for line in recorded) == 1
    assert ("scontrol requeue 4242" in recorded) == requeued
    assert (tmp_path / "run" / "tensorboard").is_dir()


def test_sbatch_requeues_after_a_sigterm_although_torchrun_exits_1(tmp_path):
    """SLURM's time-limit SIGTERM (--signal=B:TERM@300) reaches the script, which passes it on to the
    steps (scancel --signal TERM) and requeues: torchrun exits 1 after a SIGTERM even when its workers
    saved and exited 0, so its exit status alone would end the job at the time limit."""
    env, calls = _fake_slurm(tmp_path)
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("400\n")
    pid_file, bin_dir = tmp_path / "srun.pid", tmp_path / "bin"
    # torchrun as srun's task: a SIGTERM ends it with exit code 1; it ends by itself after 20 s
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {calls}\ntrap "exit 1" TERM\n'
                                  f'echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\n'
                                  'for i in $(seq 200); do sleep 0.1; done\nexit 0\n')
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "scancel $*" >> {calls}\nkill -TERM "$(cat {pid_file})"\n')
    (bin_dir / "scancel").chmod(0o755)
    proc = subprocess.Popen(["bash", SBATCH], cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            if pid_file.exists():
                break
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    recorded = calls.read_text().splitlines()
    assert "scancel --signal TERM 4242" in recorded
    assert "scontrol requeue 4242" in recorded
    with open(SBATCH) as f:
        assert "#SBATCH --signal=B:TERM@300" in f.read()


def test_single_node_launches_pick_a_free_port():
    """No test, example, README or docs command launches torchrun on a fixed port (it collides with any other
    job on the machine): one node uses ``--standalone``; a multi-node port comes from the environment."""
    import re

    # a number, or a default other than the multi-node MASTER_PORT's (which every node must agree on)
    fixed = re.compile(r"""master[-_]port["'\s,=]+["']?(\$\{(?!MASTER_PORT)\w+:-)?\d""", re.IGNORECASE)
    found = []
    for top in ("tests", "examples", "README.md", "docs", "pretrain_gpt.py", "pretrain_bert.py"):
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for name in files:
            if name.endswith((".py", ".sh", ".md", ".sbatch")) and name != __file__:
                with open(name, encoding="utf-8") as f:
                    found += [f"{os.path.relpath(name, ROOT)}: {line.strip()}" for line in f if fixed.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("script, nodes, expected", [
    ("llama/train_llama3_8b.sh", "1", "torchrun --standalone --nproc-per-node 8 "),
    ("llama/train_llama3_8b.sh", "2", "torchrun --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr localhost "
                                      "--master-port 6000 "),
])
def test_launch_uses_a_free_port_on_one_node(tmp_path, script, nodes, expected):
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/sh\necho "torchrun $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "NUM_NODES": nodes}
    out = _bash(os.path.join(EXAMPLES, script), **env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(expected), out.stdout[:300]
