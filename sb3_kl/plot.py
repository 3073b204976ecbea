"""
The KL/return timeline: the episode return on top and, on the same axis of environment steps, the KL (mean and
99th percentile, log scale, target band shaded), the KL coefficient beta and the learning rate, with alarm markers.

``python -m sb3_kl.plot LOGDIR [--out FILE.png]`` is the same as ``sb3-kl plot LOGDIR [--out FILE.png]``.
"""

import argparse
import os
import sys

import numpy as np

from sb3_kl.diagnostics.command import BAND_HELP, check_target, check_writable, load_logdir, positive_pair, run_command
from sb3_kl.diagnostics.logs import DiagnosticsError, RunLog, Series
from sb3_kl.diagnostics.report import alarm_events, resolve_band

DEFAULT_SIZE = (10.0, 8.0)  # inches
DEFAULT_DPI = 100


def _panels(runs: list[RunLog]) -> list[str]:
    """Rows of the figure: those at least one run has data for (KL always)."""
    panels = []
    if any(run.get("ep_rew_mean") is not None for run in runs):
        panels.append("return")
    panels.append("kl")
    if any(run.get("kl_coef") is not None for run in runs):
        panels.append("coef")
    if any(_varies(run.get("learning_rate")) for run in runs):
        panels.append("lr")
    return panels


def _varies(series) -> bool:
    """Whether a series exists and is not constant (a constant learning rate gets no panel, only a note in the title)."""
    if series is None or len(series) == 0:
        return False
    values = series.values[np.isfinite(series.values)]
    return bool(len(values) and values.max() > values.min())


def _constant_lr_note(runs: list[RunLog]) -> str:
    values = {float(run.get("learning_rate").values[0]) for run in runs if run.get("learning_rate") is not None}
    if not values or any(_varies(run.get("learning_rate")) for run in runs):
        return ""
    return " (learning rate " + ", ".join(f"{value:g}" for value in sorted(values)) + ", constant)"


def _positive(values: np.ndarray) -> np.ndarray:
    """Non-positive values (possible with sample estimators) cannot be drawn on a log scale."""
    return np.where(values > 0, values, np.nan)


def _draw_run(
    axes: dict,
    run: RunLog,
    color: str,
    band: tuple[float, float] | None,
    label: str | None,
    overlay: bool,
    target_kl: float | None = None,
) -> None:
    returns = run.get("ep_rew_mean")
    if returns is not None and "return" in axes:
        axes["return"].plot(returns.steps, returns.values, color=color, label=label)

    ax = axes["kl"]
    target = run.get("target_kl")
    kl = run.get("kl_mean")
    assert kl is not None
    if target is None and target_kl is not None:
        target = Series(kl.steps, np.full(len(kl), float(target_kl)))
    if target is not None:
        (lo, hi), source = resolve_band(run, band)
        ax.fill_between(
            target.steps,
            lo * target.values,
            hi * target.values,
            color=color if overlay else "tab:green",
            alpha=0.12,
            step="post",
            label=(f"{run.name}: " if overlay else "") + f"target band [{lo:g}, {hi:g}] x target ({source})",
            linewidth=0,
        )
        ax.plot(target.steps, target.values, color=color if overlay else "tab:green", lw=0.8, ls=":", drawstyle="steps-post")
    convention = run.convention_of(run.key_for("kl_mean"))
    suffix = f" ({convention})" if convention else ""
    ax.plot(kl.steps, _positive(kl.values), color=color, lw=1.5, label=f"{label}{suffix}" if overlay else f"KL mean{suffix}")
    p99 = run.get("kl_p99")
    if p99 is not None:
        ax.plot(p99.steps, _positive(p99.values), color=color, lw=0.9, ls="--", alpha=0.8, label=None if overlay else "KL p99")

    coef = run.get("kl_coef")
    if coef is not None and "coef" in axes:
        axes["coef"].plot(coef.steps, _positive(coef.values), color=color, drawstyle="steps-post")
    lr = run.get("learning_rate")
    if lr is not None and "lr" in axes:
        axes["lr"].plot(lr.steps, lr.values, color=color)

    alarms = run.get("alarms")
    if alarms is not None:
        steps, _ = alarm_events(alarms)
        for step in steps:
            for panel_ax in axes.values():
                panel_ax.axvline(step, color="tab:red", lw=0.8, alpha=0.5)
        if len(steps):
            at = np.searchsorted(kl.steps, steps).clip(0, len(kl) - 1)
            ax.scatter(steps, _positive(kl.values[at]), marker="v", color="tab:red", zorder=5, s=40, label="alarm")


def _decades(ax) -> float:
    """Number of decades spanned by a log-scaled y-axis."""
    low, high = ax.get_ylim()
    return float(np.log10(high / low)) if low > 0 else np.inf


def draw_timeline(
    runs: list[RunLog],
    out: str,
    band: tuple[float, float] | None = None,
    size: tuple[float, float] = DEFAULT_SIZE,
    dpi: int = DEFAULT_DPI,
    title: str | None = None,
    target_kl: float | None = None,
) -> str:
    """
    Draw one figure with the given runs (one run, or several overlaid) and save it.

    :param runs: Runs that logged a mean KL
    :param out: Output image path (the format follows the extension, e.g. ``.png``)
    :param band: Target band as multiples of the logged target KL; None: each run's own band (the controller's
        ``kl_band`` it logged, else :data:`~sb3_kl.diagnostics.report.DEFAULT_BAND`), named in the legend
    :param size: Figure size in inches; the image is ``size * dpi`` pixels
    :param dpi: Resolution
    :param title: Figure title (default: the run name, or the number of runs)
    :param target_kl: Target KL drawn (with its band) for runs that did not log one
    :return: ``out``
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    overlay = len(runs) > 1
    panels = _panels(runs)
    ratios = {"return": 2.0, "kl": 2.5, "coef": 1.0, "lr": 1.0}
    fig, ax_list = plt.subplots(
        len(panels), 1, sharex=True, figsize=size, dpi=dpi, gridspec_kw={"height_ratios": [ratios[p] for p in panels]}
    )
    ax_list = np.atleast_1d(ax_list)
    axes = dict(zip(panels, ax_list, strict=True))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        _draw_run(axes, run, colors[i % len(colors)], band, run.name if overlay else None, overlay, target_kl)

    labels = {
        "return": "episode return\n(rollout/ep_rew_mean)",
        "kl": "KL per update\n(log scale)",
        "coef": "KL coef β",
        "lr": "learning rate",
    }
    for panel, ax in axes.items():
        ax.set_ylabel(labels[panel], fontsize=9)
        ax.grid(True, alpha=0.3)
    axes["kl"].set_yscale("log")
    if "coef" in axes:
        axes["coef"].set_yscale("log")
        if _decades(axes["coef"]) < 2:  # few decades: ticks at 1, 2, 5 x 10^n in plain numbers
            axes["coef"].yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axes["coef"].yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axes["coef"].yaxis.set_minor_formatter(NullFormatter())
    if "lr" in axes:
        axes["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_list[-1].set_xlabel("environment steps")
    legend_axes = [axes["return"], axes["kl"]] if overlay and "return" in axes else [axes["kl"]]
    for legend_ax in legend_axes:  # with --overlay the run names go on the return panel, the bands on the KL panel
        handles, names = legend_ax.get_legend_handles_labels()
        if overlay and legend_ax is axes["kl"] and len(legend_axes) > 1:  # run names are already on the return panel
            kept = [(n, h) for n, h in zip(names, handles, strict=True) if n not in {run.name for run in runs}]
            names, handles = [n for n, _ in kept], [h for _, h in kept]
        if handles:
            unique = dict(zip(names, handles, strict=True))
            legend_ax.legend(unique.values(), unique.keys(), fontsize=8, loc="best")
    fig.suptitle((title or (runs[0].name if not overlay else f"{len(runs)} runs")) + _constant_lr_note(runs), fontsize=11)
    fig.tight_layout()
    # no bbox_inches="tight": the image keeps the requested pixel size
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def output_paths(out: str, runs: list[RunLog], overlay: bool) -> list[str]:
    """
    :param out: The ``--out`` path
    :param runs: The runs to draw
    :param overlay: Whether all runs go in one figure
    :return: One path per figure, ``.png`` when ``out`` names no extension (as matplotlib writes it): ``out`` itself
        for one figure, else ``<stem>-<run name><ext>`` per run
    """
    stem, ext = os.path.splitext(out)
    if overlay or len(runs) == 1:
        return [out if ext else f"{out}.png"]
    return [f"{stem}-{run.name.replace(os.sep, '_')}{ext or '.png'}" for run in runs]


def plot_command(args: argparse.Namespace) -> int:
    """
    Run ``sb3-kl plot`` (the options of :func:`add_plot_arguments`).

    :param args: The parsed options
    :return: Exit status: 0, or 2 when some runs were skipped
    """
    band = positive_pair(args.band, "--band", ("LOW", "HIGH"))
    check_target(args.target)
    size = (float(args.size[0]), float(args.size[1]))
    if min(size) <= 0 or args.dpi <= 0:
        raise DiagnosticsError("--size and --dpi must be positive")
    if args.out.endswith(("/", os.sep)) or os.path.isdir(args.out):
        folder = args.out.rstrip("/" + os.sep)
        raise DiagnosticsError(f"cannot write --out {args.out}: it is a directory, give a file name (e.g. {folder}/kl.png)")
    runs, status = load_logdir(args.logdir)
    groups = [runs] if args.overlay else [[run] for run in runs]
    paths = output_paths(args.out, runs, args.overlay)
    for path in paths:
        check_writable(path, "--out")
    for group, path in zip(groups, paths, strict=True):
        try:
            draw_timeline(group, path, band=band, size=size, dpi=args.dpi, target_kl=args.target)
        except OSError as error:
            raise DiagnosticsError(f"cannot write {path}: {error.strerror or error}") from None
        except ValueError as error:  # e.g. an image format matplotlib does not know
            raise DiagnosticsError(f"cannot write {path}: {error}") from None
        print(f"wrote {path} ({', '.join(run.name for run in group)})")
    return status


def add_plot_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """
    Give ``parser`` the options of ``sb3-kl plot`` and :func:`plot_command` to run.

    :param parser: The ``plot`` subcommand's parser (or that of ``python -m sb3_kl.plot``)
    :return: The parser
    """
    parser.add_argument("logdir", help="TensorBoard log directory, run directory, event file or progress.csv")
    parser.add_argument("--out", default="kl_timeline.png", help="image file (several runs: one file per run, suffixed)")
    parser.add_argument("--overlay", action="store_true", help="draw all runs in one figure")
    parser.add_argument("--band", nargs=2, type=float, default=None, metavar=("LOW", "HIGH"), help=BAND_HELP)
    parser.add_argument("--target", type=float, help="target KL for runs that did not log one (draws their band)")
    parser.add_argument("--size", nargs=2, type=float, default=[10.0, 8.0], metavar=("W", "H"), help="inches (default 10 8)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch (default 100: a 1000x800 image)")
    parser.set_defaults(func=plot_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m sb3_kl.plot``: the ``plot`` subcommand of ``sb3-kl``."""
    parser = argparse.ArgumentParser(prog="python -m sb3_kl.plot", description="Draw the KL/return timeline of each run.")
    return run_command(add_plot_arguments(parser), argv)


if __name__ == "__main__":
    sys.exit(main())
