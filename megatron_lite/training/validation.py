"""Megatron-LM's validation flags: several validation sets, full validation, and evaluation-only runs.

* ``--multiple-validation-sets``: each dataset of the validation split (``--valid-data-path p1 p2 ...``,
  or ``--data-path p1 p2 ...`` with ``--split``; prefixes only, no weights) is built and evaluated on its
  own: one loss line and one set of TensorBoard / W&B scalars (``lm loss validation NAME``) per dataset,
  NAME from ``--validation-set-names`` or its index (0, 1, ...).
* ``--full-validation``: each pass reads the validation dataset(s) from their first sample, one epoch,
  as ``len(dataset) // global batch`` full global batches (the same count on every rank: it comes
  from the dataset's length); the samples past the last full global batch are not evaluated, and a
  dataset smaller than one global batch is refused. Such a pass leaves the ``--eval-iters``
  position (``consumed_valid_samples``, saved with checkpoints) where it was.
* ``--skip-train``: no step; validation and (where the split has data) test at the loaded iteration,
  then the run returns; no checkpoint is written. A run that trains to --train-iters tests at its end too.

The GPT script hands ``pretrain`` a :class:`ValidationSets` instead of a validation iterator when one
of the first two flags is given (:func:`validation_sets`); the loop evaluates each set in ``_Training.validate`` (training/loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..data.builder import DataConfigError, parse_data_path, parse_split
from ..data.samplers import build_pretraining_data_loader, cyclic_batches
from ..errors import ConfigError
from .batch_rampup import validation_batch


@dataclass
class ValidationSet:
    """One dataset evaluated on its own: its name (None: the one validation split, logged as before),
    ``iterator`` (or a list, one per model chunk) for --eval-iters passes, or ``fresh()`` making one
    from the first sample for a full pass, and the global batches one pass reads."""

    name: str | None
    batches: int
    iterator: object = None
    fresh: Callable | None = None

    def pass_iterator(self):
        return self.fresh() if self.fresh is not None else self.iterator


class ValidationSets(list):
    """The run's validation sets, in order (a list of :class:`ValidationSet`)."""

    full = False


def check_validation_flags(config) -> None:
    """The command line's refusals for the validation flags (one ConfigError line each)."""
    t, d = config.training, config.data
    if t.validation_set_names is not None and not t.multiple_validation_sets:
        raise ConfigError("--validation-set-names names the datasets of --multiple-validation-sets; add that flag "
                          "or drop the names")
    for flag, on in (("--full-validation", t.full_validation), ("--multiple-validation-sets", t.multiple_validation_sets)):
        if on and d.mock_data:
            raise ConfigError(f"{flag} evaluates validation datasets read from files, and --mock-data has none; give "
                              "--data-path (or --valid-data-path), or drop the flag")
        if on and d.sft:
            raise ConfigError(f"{flag} is built for GPT pretraining data (as in Megatron-LM), not --sft conversations; "
                              "drop the flag")
    if t.full_validation and t.eval_iters == 0:
        raise ConfigError("--full-validation with --eval-iters 0: --eval-iters 0 turns validation off, so nothing "
                          "would be evaluated; drop one of them")
    if t.skip_train and t.eval_iters == 0:
        raise ConfigError("--skip-train with --eval-iters 0 evaluates nothing (validation is off); give --eval-iters N "
                          "(and --full-validation for the whole validation set)")
    if t.multiple_validation_sets and not d.mock_data:
        _check_multiple_sets(config)


def _check_multiple_sets(config) -> None:
    t, d = config.training, config.data
    per_split = any((d.train_data_path, d.valid_data_path, d.test_data_path))
    flag, paths = ("--valid-data-path", d.valid_data_path) if per_split else ("--data-path", d.data_path)
    if paths is None:
        raise ConfigError(f"--multiple-validation-sets needs the validation datasets: give {flag} p1 p2 ...")
    try:
        prefixes, weights = parse_data_path(paths, flag)
        valid_weight = parse_split(d.split)[1]
    except DataConfigError as err:
        raise ConfigError(str(err)) from None
    if weights is not None:
        raise ConfigError(f"--multiple-validation-sets evaluates each dataset of {flag} on its own, so {flag} takes "
                          f"prefixes only, no weights (got {' '.join(paths)}); drop the weights")
    if not per_split and valid_weight == 0:
        raise ConfigError(f"--multiple-validation-sets with --split {d.split}: the validation split has weight 0, so "
                          "there is nothing to evaluate; give it a weight (e.g. --split 98,2,0)")
    names = t.validation_set_names
    if names is not None and len(names) != len(prefixes):
        raise ConfigError(f"--validation-set-names gives {len(names)} name(s) for the {len(prefixes)} validation "
                          f"dataset(s) of {flag}; give one name per dataset")
    if names is not None and len(set(names)) != len(names):
        raise ConfigError(f"--validation-set-names {' '.join(names)}: a name is given twice; the loss lines and "
                          "scalars need one name per dataset")


def set_names(config, count: int) -> list[str | None]:
    """The logged name of each validation dataset: --validation-set-names, else its index; None for the one split."""
    t = config.training
    if not t.multiple_validation_sets:
        return [None] * count
    return list(t.validation_set_names) if t.validation_set_names else [str(i) for i in range(count)]


def full_batches(config, dataset, name: str | None) -> int:
    """--full-validation: the full global batches ``dataset`` holds (at least one, or a DataConfigError)."""
    batch = validation_batch(config)
    batches = len(dataset) // batch
    if batches == 0:
        which = "the validation split" if name is None else f"validation set {name}"
        raise DataConfigError(f"--full-validation: {which} holds {len(dataset)} samples, fewer than one global batch "
                              f"of {batch} (--global-batch-size); give it more data or use a smaller global batch")
    return batches


def validation_sets(config, state, datasets: list, consumed_valid: int, num_chunks: int, wrap=None) -> ValidationSets:
    """The :class:`ValidationSets` of ``datasets`` (the validation split, or its datasets one by one):
    --eval-iters passes continue from ``consumed_valid`` (the same position in every set: each pass reads
    --eval-iters batches of each); --full-validation passes start at each set's first sample."""
    t, d = config.training, config.data
    step = t.micro_batch_size * state.dp_size

    def stream(ds, start: int):
        it = cyclic_batches(ds, start, t.micro_batch_size, state.dp_rank, state.dp_size, d.num_workers)
        return it if wrap is None else wrap(it)

    def per_chunk(make):
        return make() if num_chunks == 1 else [make() for _ in range(num_chunks)]

    out = ValidationSets()
    out.full = t.full_validation
    for name, ds in zip(set_names(config, len(datasets)), datasets):
        if t.full_validation:
            out.append(ValidationSet(name, full_batches(config, ds, name),
                                     fresh=lambda ds=ds: per_chunk(lambda: _one_epoch(config, state, ds, wrap))))
        else:
            usable = len(ds) - len(ds) % step
            start = consumed_valid % usable if usable else 0
            out.append(ValidationSet(name, t.eval_iters, iterator=per_chunk(lambda ds=ds, s=start: stream(ds, s))))
    return out


def _one_epoch(config, state, dataset, wrap):
    t = config.training
    loader = build_pretraining_data_loader(dataset, 0, t.micro_batch_size, state.dp_rank, state.dp_size, "single",
                                           config.data.num_workers, t.seed)
    return iter(loader) if wrap is None else wrap(iter(loader))


def split_samples(config, train: int, valid: int, test: int) -> list:
    """[train, valid, test] samples to build: --skip-train builds no training set; --full-validation one
    epoch of the validation split (None); --multiple-validation-sets builds its datasets apart (0 here);
    the test split is built apart (:func:`test_set`), so 0."""
    t = config.training
    valid = 0 if t.multiple_validation_sets else None if t.full_validation else valid
    return [0 if t.skip_train else train, valid, 0]


def test_set(config, state, build_test, num_chunks: int, wrap=None) -> ValidationSet | None:
    """The test pass (at the end of training, and of --skip-train): --eval-iters global batches of the test split from its first sample, or
    None when the data gives no test split (``build_test(samples)`` returns the dataset or None; a split
    too small to build is said in one line and skipped, as a run that never tests would not notice it)."""
    from ..console import print_rank_0

    t = config.training
    try:
        dataset = build_test(t.eval_iters * t.global_batch_size)
    except DataConfigError as err:
        print_rank_0(f"> no test pass at the end: {err}")
        return None
    if dataset is None:
        return None
    sets = validation_sets(_plain(config), state, [dataset], 0, num_chunks, wrap)
    return ValidationSet("test", t.eval_iters, iterator=sets[0].iterator)


def _plain(config):
    """``config`` read as a run without the validation flags (the test split's iterator)."""
    import copy
    import dataclasses

    plain = copy.copy(config)
    plain.training = dataclasses.replace(config.training, full_validation=False, multiple_validation_sets=False)
    return plain
