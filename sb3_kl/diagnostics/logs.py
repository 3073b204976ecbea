"""
Reading SB3 runs back from disk: TensorBoard event files (through TensorBoard's own ``EventAccumulator``)
and SB3's CSV logger output (``progress.csv``).

A *run* is one directory holding ``events.out.tfevents.*`` files (one ``tb_log_name_<n>`` folder of a
``tensorboard_log`` directory), or one ``progress.csv``. The x-axis is the environment step: SB3 writes every
value at ``num_timesteps`` (TensorBoard step, or the ``time/total_timesteps`` column of the CSV).

The KL keys differ between sb3_kl's algorithms (``train/kl``, ...) and a stock agent watched by
``KLMonitorCallback`` (``kl/mean``, ...): :data:`KL_KEYS` maps one canonical name to both spellings. The KL figures
of a run (mean, p99, target, beta) all come from one source, so that they are in one convention: the algorithm's own
``train/`` keys when it logged ``train/kl``, else the monitor's ``kl/`` keys, where the mean compared with
``kl/target`` is ``kl/mean_in_target_convention`` (the KL in the convention the algorithm states its target in). A
stock agent without a target of its own may have one from ``KLAlarmCallback``/``KLAdaptiveLRCallback``:
``kl/target_kl``, in the convention of ``kl/mean``.
"""

import csv
import fnmatch
import glob
import math
import os
import struct
import warnings
from dataclasses import dataclass, field

import numpy as np

# canonical name -> logger keys, in order of preference (sb3_kl algorithms first, then KLMonitorCallback)
KL_KEYS: dict[str, tuple[str, ...]] = {
    "kl_mean": ("train/kl", "kl/mean_in_target_convention", "kl/mean"),
    "kl_p99": ("train/kl_p99", "kl/p99"),
    # (the algorithm's target first; a KL callback's ``kl/target_kl`` is only logged beside the ``kl/mean`` it is in)
    "target_kl": ("train/target_kl", "kl/target", "kl/target_kl"),
    "kl_coef": ("train/kl_coef", "kl/coef"),
    "learning_rate": ("train/learning_rate", "kl/learning_rate"),
    "alarms": ("kl/alarms",),
    "kl_band_low": ("train/kl_band_low",),
    "kl_band_high": ("train/kl_band_high",),
    "ep_rew_mean": ("rollout/ep_rew_mean",),
    # the monitor's own figures, in its convention: what observation normalization alone moved, beside the update's KL
    "normalization_shift": ("kl/normalization_shift",),
    "monitor_kl_mean": ("kl/mean",),
}

#: The canonical names read from the run's one KL source (the algorithm's ``train/`` keys or the monitor's ``kl/``)
KL_SOURCE_NAMES = ("kl_mean", "kl_p99", "target_kl", "kl_coef")
#: Text key naming the convention of each KL key (CSV logs only: SB3 sends no text to TensorBoard's scalars)
CONVENTION_KEYS = {
    "train/": "train/kl_convention",
    "kl/mean": "kl/convention",
    "kl/p99": "kl/convention",
    "kl/mean_in_target_convention": "kl/target_convention",
    "kl/target": "kl/target_convention",
    "kl/target_kl": "kl/convention",
}

TIMESTEP_COLUMN = "time/total_timesteps"
EVENT_FILE_PATTERN = "events.out.tfevents.*"
CSV_FILE_NAME = "progress.csv"


class DiagnosticsError(Exception):
    """A problem with the user's input (missing directory, unreadable file, no KL keys), reported in one line."""


@dataclass
class Series:
    """
    One logged scalar: values at environment steps, sorted by step, one value per step (the last one written).

    :param steps: Environment steps (``num_timesteps`` at each dump)
    :param values: The logged values
    """

    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class RunLog:
    """
    The scalars of one run.

    :param name: Display name (path relative to the directory given on the command line)
    :param path: The run directory or file
    :param source: ``"tensorboard"`` or ``"csv"``
    :param scalars: Logger key -> :class:`Series`
    :param texts: Logger key -> last text value (CSV logs: e.g. ``train/kl_convention``)
    :param notes: What reading the log noticed (e.g. timesteps that go back in a ``progress.csv``)
    """

    name: str
    path: str
    source: str
    scalars: dict[str, Series] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def _logged(self, key: str) -> bool:
        return key in self.scalars and len(self.scalars[key]) > 0

    @property
    def kl_prefix(self) -> str | None:
        """``"train/"`` when the algorithm logged its own KL (``train/kl``), ``"kl/"`` for a monitor's, else None."""
        if self._logged("train/kl"):
            return "train/"
        if self._logged("kl/mean") or self._logged("kl/mean_in_target_convention"):
            return "kl/"
        return None

    def key_for(self, canonical: str) -> str | None:
        """
        :param canonical: A name of :data:`KL_KEYS`
        :return: The logger key this run uses for it, or None if the run did not log it. The KL figures
            (:data:`KL_SOURCE_NAMES`) come from the run's one KL source (:attr:`kl_prefix`); a monitor's ``kl/p99``
            only when it is in the convention of the mean it stands beside (see :meth:`_monitor_p99_matches`)
        """
        prefix = self.kl_prefix if canonical in KL_SOURCE_NAMES else None
        for key in KL_KEYS[canonical]:
            if prefix is not None and not key.startswith(prefix):
                continue
            if self._logged(key):
                if key == "kl/p99" and not self._monitor_p99_matches():
                    return None
                return key
        return None

    def _monitor_p99_matches(self) -> bool:
        """
        Whether the monitor's ``kl/p99`` (its own convention) is in the convention of the mean the report uses: always
        with ``kl/mean``; with ``kl/mean_in_target_convention`` when the logged conventions agree or, without them
        (TensorBoard), when that series equals ``kl/mean`` at every step (the monitor logs its own mean there when it
        measures in the target's convention).
        """
        if not self._logged("kl/mean_in_target_convention"):
            return True
        own, target = self.texts.get("kl/convention"), self.texts.get("kl/target_convention")
        if own is not None and target is not None:
            return own == target
        if not self._logged("kl/mean"):
            return False
        steps, (mean, in_target) = align(self.scalars["kl/mean"], self.scalars["kl/mean_in_target_convention"])
        return len(steps) > 0 and bool(np.array_equal(mean, in_target))

    def convention_of(self, key: str | None) -> str | None:
        """
        :param key: A logger key of this run (None: None)
        :return: The KL convention the run logged for it (e.g. ``forward/analytic/sum``), or None when the log does not
            say (TensorBoard logs, logs of sb3-kl versions before the convention was logged)
        """
        if key is None:
            return None
        text_key = CONVENTION_KEYS["train/"] if key.startswith("train/") else CONVENTION_KEYS.get(key)
        return None if text_key is None else self.texts.get(text_key)

    def get(self, canonical: str) -> Series | None:
        """
        :param canonical: A name of :data:`KL_KEYS`
        :return: The series under the first spelling this run logged, or None
        """
        key = self.key_for(canonical)
        return None if key is None else self.scalars[key]

    @property
    def has_kl(self) -> bool:
        """Whether the run logged a mean KL (``train/kl``, ``kl/mean_in_target_convention`` or ``kl/mean``)."""
        return self.key_for("kl_mean") is not None


def _make_series(pairs: dict[int, float]) -> Series:
    steps = np.array(sorted(pairs), dtype=np.int64)
    return Series(steps=steps, values=np.array([pairs[s] for s in steps], dtype=np.float64))


def _check_event_file(path: str) -> None:
    """
    Check that TensorBoard reads every complete record of an event file: the records' framing (length and its
    checksum) is walked to the end, and the events TensorBoard's loader yields are counted against it (the loader stops
    at the first record whose checksum fails, without an error). An incomplete last record (a run still writing) is
    not counted.

    :raises DiagnosticsError: naming the file and the first record that cannot be read
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    with open(path, "rb") as file:
        data = file.read()
    position, complete, damaged = 0, 0, False
    while position + 12 <= len(data):
        header = data[position : position + 8]
        if masked_crc32c(header) != struct.unpack("<I", data[position + 8 : position + 12])[0]:
            damaged = True
            break
        end = position + 12 + struct.unpack("<Q", header)[0] + 4
        if end > len(data):  # the last record is still being written
            break
        position, complete = end, complete + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read = sum(1 for _ in EventFileLoader(path).Load())
    if damaged or read < complete:
        raise DiagnosticsError(
            f"{path} is corrupt: TensorBoard reads {read} of its records and stops at a damaged one, so the run would "
            "read short. Use another copy of the log, or the run's progress.csv"
        )


def read_tensorboard(run_dir: str, name: str) -> RunLog:
    """
    Read every scalar of a TensorBoard run directory with TensorBoard's ``EventAccumulator``.

    :param run_dir: Directory holding ``events.out.tfevents.*`` files
    :param name: Display name of the run
    :return: The run's scalars
    """
    # Imported here: TensorBoard's import is slow and only needed for event files
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(run_dir, size_guidance={SCALARS: 0})  # 0 = keep every point
    try:
        accumulator.Reload()
    except Exception as error:  # a corrupt record raises DataLossError or a protobuf DecodeError
        raise DiagnosticsError(f"cannot read TensorBoard events in {run_dir}: {type(error).__name__}: {error}") from None
    # TensorBoard's reader stops quietly at a record that fails its checksum: the run would read short
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        _check_event_file(path)
    run = RunLog(name=name, path=run_dir, source="tensorboard")
    for tag in accumulator.Tags().get(SCALARS, []):
        pairs: dict[int, float] = {}
        for event in accumulator.Scalars(tag):
            pairs[int(event.step)] = float(event.value)
        run.scalars[tag] = _make_series(pairs)
    return run


def _to_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def read_csv(csv_path: str, name: str) -> RunLog:
    """
    Read SB3's CSV logger output. Empty cells (a key not written at that dump) are skipped; text values are kept in
    :attr:`RunLog.texts` (the last one of each key), numbers in :attr:`RunLog.scalars`. A header row further down
    (logs appended to one file) is read as the header of the rows after it; where the timesteps go back (a run that
    started again from step 0 into the same file), later values replace earlier ones at the same step and
    :attr:`RunLog.notes` says so.

    :param csv_path: Path of ``progress.csv``
    :param name: Display name of the run
    :return: The run's scalars
    """
    try:
        with open(csv_path, newline="") as file_handler:
            rows = list(csv.reader(file_handler))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DiagnosticsError(f"cannot read {csv_path}: {error}") from None
    if len(rows) < 2 or TIMESTEP_COLUMN not in rows[0]:
        raise DiagnosticsError(f"{csv_path} is not an SB3 progress.csv (no '{TIMESTEP_COLUMN}' column or no rows)")
    columns: dict[str, dict[int, float]] = {}
    texts: dict[str, str] = {}
    header, headers_seen, went_back, last_step = rows[0], 1, 0, -math.inf
    for cells in rows[1:]:
        if TIMESTEP_COLUMN in cells:  # the header of logs appended after the first
            header, headers_seen = cells, headers_seen + 1
            continue
        row = dict(zip(header, cells, strict=False))
        step = _to_float(row.get(TIMESTEP_COLUMN) or "")
        if step is None or not math.isfinite(step):
            continue
        went_back += int(step < last_step)
        last_step = step
        for key, text in row.items():
            if key == TIMESTEP_COLUMN or not text:
                continue
            value = _to_float(text)
            if value is not None:
                columns.setdefault(key, {})[int(step)] = value
            else:
                texts[key] = text
    run = RunLog(name=name, path=csv_path, source="csv", texts=texts)
    run.scalars = {key: _make_series(pairs) for key, pairs in columns.items()}
    if headers_seen > 1:
        run.notes.append(f"{csv_path} holds {headers_seen} logs appended one after the other (a header row each)")
    if went_back:
        run.notes.append(
            f"the timesteps of {csv_path} go back {went_back} time(s) (a run started again from an earlier step into "
            "the same file): where steps repeat, the later value is used"
        )
    return run


def find_runs(logdir: str) -> list[tuple[str, str, str]]:
    """
    Find the runs below ``logdir``.

    :param logdir: A TensorBoard log directory, one run directory, an event file or a ``progress.csv``
    :return: ``(name, path, source)`` per run, sorted by name. A directory with both event files and a
        ``progress.csv`` counts once, as TensorBoard.
    """
    if not os.path.exists(logdir):
        raise DiagnosticsError(f"{logdir} does not exist")
    if os.path.isfile(logdir):
        name = os.path.basename(os.path.dirname(os.path.abspath(logdir)))
        if os.path.basename(logdir).startswith("events.out.tfevents"):
            return [(name, logdir, "tensorboard")]
        if logdir.endswith(".csv"):
            return [(name, logdir, "csv")]
        raise DiagnosticsError(f"{logdir} is neither a TensorBoard event file nor a progress.csv")
    runs = []
    root = os.path.abspath(logdir)
    for directory, _, files in os.walk(root):
        relative = os.path.relpath(directory, root)
        name = os.path.basename(root) if relative == "." else relative
        if any(fnmatch.fnmatch(file, EVENT_FILE_PATTERN) for file in files):
            runs.append((name, directory, "tensorboard"))
        elif CSV_FILE_NAME in files:
            runs.append((name, os.path.join(directory, CSV_FILE_NAME), "csv"))
    if not runs:
        raise DiagnosticsError(
            f"no TensorBoard event files or progress.csv found under {logdir}: log the run with tensorboard_log=DIR or "
            "an SB3 CSV logger; a zoo run needs `-tb DIR` with rl_zoo3.train (python -m sb3_kl.zoo train writes a "
            "progress.csv into the run folder by itself)"
        )
    return sorted(runs)


def load_run(name: str, path: str, source: str) -> RunLog:
    """
    :param name: Display name
    :param path: Run directory (TensorBoard), event file or CSV path
    :param source: ``"tensorboard"`` or ``"csv"``
    :return: The run's scalars
    """
    if source == "tensorboard":
        run = read_tensorboard(path, name)
        # SB3 sends no text to TensorBoard: the KL conventions are in a progress.csv written beside (CSV + TensorBoard)
        beside = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), CSV_FILE_NAME)
        if os.path.isfile(beside):
            try:
                run.texts = read_csv(beside, name).texts
            except DiagnosticsError:
                pass  # the scalars come from the events; an unreadable CSV only costs the labels
    else:
        run = read_csv(path, name)
    if not run.scalars:
        raise DiagnosticsError(f"no scalar could be read from run {name} ({path}): empty, corrupt or not an SB3 log")
    return run


def load_runs(logdir: str) -> tuple[list[RunLog], list[str]]:
    """
    Load every run below ``logdir`` that logged a mean KL.

    :param logdir: See :func:`find_runs`
    :return: The runs with KL keys, and one problem line per run that was skipped (unreadable or without KL keys)
    """
    runs, problems = [], []
    for name, path, source in find_runs(logdir):
        try:
            run = load_run(name, path, source)
        except DiagnosticsError as error:
            problems.append(str(error))
            continue
        if not run.has_kl:
            expected = " or ".join(KL_KEYS["kl_mean"])
            problems.append(
                f"run {name} ({path}) has no KL keys ({expected}); log with an sb3_kl algorithm or KLMonitorCallback, "
                "for two updates or more (SB3 writes an update's train/ values with the next rollout's log row: the "
                "last update's are never written)"
            )
            continue
        runs.append(run)
    return runs, problems


def align(*series: Series) -> tuple[np.ndarray, list[np.ndarray]]:
    """
    Keep the steps at which every series has a finite value.

    :param series: The series to align
    :return: The common steps and the values of each series at those steps
    """
    common = series[0].steps
    for other in series[1:]:
        common = np.intersect1d(common, other.steps)
    values = [s.values[np.searchsorted(s.steps, common)] for s in series]
    finite = np.all([np.isfinite(v) for v in values], axis=0) if len(common) else np.zeros(0, dtype=bool)
    return common[finite], [v[finite] for v in values]
