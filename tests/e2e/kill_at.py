"""Run pretrain_gpt.py and SIGKILL this process at a chosen moment (for the kill tests).

    python tests/e2e/kill_at.py MOMENT ITERATION pretrain flags...

(or ``main([MOMENT, ITERATION, *flags])`` in a process of its own: tests.harness.run_in_new_process)

MOMENT is ``step`` (iteration ITERATION's gradients are computed, the optimizer has not stepped),
``save`` (the save of ITERATION has written its RNG file and half of the model file), or
``tracker`` (the tracker file already names ITERATION, the save has not returned), or ``async``
(the ``--async-save`` of ITERATION has written every file and is about to be finalized). Every rank
that reaches the moment kills itself, as a power cut would.

MOMENT ``peer:N`` kills the last rank only, as a node failing would: in the synchronous save of
ITERATION, once its own part of the save's N-th step is done, just before the ranks agree on that step
(1: sweeping old temporary folders; torch: 2 the files, 3 the rename and the tracker; torch_dist: 2 the
RNG files and common.pt, 3 the pieces, 4 the rename and the tracker). The other ranks see a peer
vanish in the middle of the save.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron_lite.checkpoint.dist_save as dist_save  # noqa: E402
import megatron_lite.checkpoint.training as ckpt_training  # noqa: E402
import megatron_lite.training.loop as loop  # noqa: E402
import megatron_lite.training.step as training_step  # noqa: E402
import pretrain_gpt  # noqa: E402


def _die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_peer_at_agreement(step: int, target: int) -> None:
    """The last rank dies before the ``step``-th agreement of the save of ``target`` (see the docstring)."""
    if int(os.environ.get("RANK", "0")) != int(os.environ.get("WORLD_SIZE", "1")) - 1:
        return
    save, agree = loop.save_checkpoint, ckpt_training.on_every_rank
    seen = {"iteration": None, "n": 0}

    def saving(iteration, *args, **kwargs):
        seen["iteration"], seen["n"] = iteration, 0
        return save(iteration, *args, **kwargs)

    def dying(local_step):
        if seen["iteration"] != target:
            return agree(local_step)
        seen["n"] += 1
        if seen["n"] == step:
            local_step()
            _die()
        return agree(local_step)

    loop.save_checkpoint, ckpt_training.on_every_rank = saving, dying


def main(args=None):
    """``args``: MOMENT ITERATION flags... (default: this script's command line)."""
    args = sys.argv[1:] if args is None else args
    moment, target, argv = args[0], int(args[1]), args[2:]
    calls = {"n": 0}
    if moment == "step":
        finalize = training_step.finalize_model_grads  # (called by train_step, training/step.py)

        def finalize_then_die(*args, **kwargs):
            calls["n"] += 1
            finalize(*args, **kwargs)
            if calls["n"] == target:
                _die()

        training_step.finalize_model_grads = finalize_then_die
    elif moment == "save":
        save = ckpt_training.atomic_save

        def half_save(obj, path):
            if f"iter_{target:07d}" in path and path.endswith("model_optim_rng.pt"):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(f"{path}.tmp.{os.getpid()}", "wb") as f:
                    f.write(b"PK\x03\x04 half a file")
                _die()
            save(obj, path)

        ckpt_training.atomic_save = half_save
    elif moment == "tracker":
        write = dist_save.atomic_write_text  # both formats' saves end in dist_save.finalize_save

        def write_then_die(path, text):
            write(path, text)
            if text.strip() == str(target):
                _die()

        dist_save.atomic_write_text = write_then_die
    elif moment == "async":
        finalize = dist_save.finalize_save

        def die_before_finalize(root, iteration):
            if iteration == target:
                _die()
            finalize(root, iteration)

        dist_save.finalize_save = die_before_finalize
    elif moment.startswith("peer:"):
        _kill_peer_at_agreement(int(moment[len("peer:"):]), target)
    else:
        raise SystemExit(f"unknown moment {moment}")
    pretrain_gpt.main(argv)


if __name__ == "__main__":
    main()
