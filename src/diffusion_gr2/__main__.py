"""``python -m diffusion_gr2``: the operations commands, or the Kedro project like ``kedro run``.

python -m diffusion_gr2 lineage models:/diffusion-gr2@champion   # or a run id
python -m diffusion_gr2 registry show
python -m diffusion_gr2 registry promote diffusion-gr2 3
python -m diffusion_gr2 registry rollback diffusion-gr2 [--to 2]
python -m diffusion_gr2 serve [--which] [--port 5001]              # the best champion there is, and why
python -m diffusion_gr2 summary                                    # one line: what will serve (`make run`)
python -m diffusion_gr2 retrain [--env ENV] [--force]             # what `make retrain` and cron run
python -m diffusion_gr2 results [--reporting data/08_reporting] [--strict]  # the results table (Markdown)
python -m diffusion_gr2 run [kedro run options]                    # kedro run, on one process or many:
accelerate launch [--config_file conf/accelerate/X.yaml] -m diffusion_gr2 run [kedro run options]
python -m diffusion_gr2 [kedro run options]                        # anything else: kedro run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

OPS_COMMANDS = ("lineage", "registry", "results", "retrain", "serve", "summary")
DEFAULT_STORE = "sqlite:///mlflow.db"


class NoStoreError(LookupError):
    """The MLflow store the commands would read does not exist (no run has written it yet)."""


def _store_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_STORE)


def _check_store(uri: str) -> None:
    """`NoStoreError` when `uri` names a local store that is not there (opening it would create it)."""
    path = None
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
    elif uri.startswith("file://"):
        path = Path(uri.removeprefix("file://"))
    if path is not None and not path.exists():
        raise NoStoreError(f"no MLflow store at {uri}: run `make run`, then `make register`")


def _mlflow_client(must_exist: bool = True):  # noqa: ANN202 (an MlflowClient: mlflow imported here)
    """A client on the project's store (``MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``);
    `NoStoreError` when `must_exist` and it is a local store not yet written (opening would create it)."""
    import mlflow

    from diffusion_gr2.core.env import quiet_offline_environment

    quiet_offline_environment()
    uri = _store_uri()
    if must_exist:
        _check_store(uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return mlflow.MlflowClient()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion_gr2", description="Diffusion-GR2 operations")
    sub = parser.add_subparsers(dest="command", required=True)
    lineage = sub.add_parser("lineage", help="the chain from a model version or run back to the raw files")
    lineage.add_argument("target", help="models:/NAME@ALIAS, models:/NAME/VERSION or an MLflow run id")
    registry = sub.add_parser("registry", help="registered versions and their aliases")
    actions = registry.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="versions, aliases, tau and gate decision")
    show.add_argument("name", nargs="?", default=None)
    show.add_argument("--card", nargs="?", const="champion", default=None, metavar="VERSION_OR_ALIAS",
                      help="print the model card of a version of NAME (default diffusion-gr2 @champion)")  # fmt: skip
    promote = actions.add_parser("promote", help="point champion at a version")
    promote.add_argument("name")
    promote.add_argument("version")
    promote.add_argument("--reason", default="manual promotion")
    rollback = actions.add_parser("rollback", help="move champion back (to the version it replaced)")
    rollback.add_argument("name")
    rollback.add_argument("--to", default=None, help="the version to serve (default: the previous champion)")
    rollback.add_argument("--reason", default="manual rollback")
    retrain = sub.add_parser(
        "retrain",
        help="kedro run --pipelines retrain, unless nothing new arrived and a champion serves",
    )
    retrain.add_argument("--env", default=None, help="Kedro environment (default: the project's)")
    retrain.add_argument("--force", action="store_true", help="retrain even when nothing new arrived")
    results = sub.add_parser("results", help="the results table of the last run, from its reports")
    results.add_argument("--reporting", default="data/08_reporting", help="the run's reporting folder")
    results.add_argument(
        "--strict", action="store_true", help="refuse reports that came from more than one run (exit 1)"
    )
    serve = sub.add_parser(
        "serve", help="serve the best champion: diffusion-gr2, else the teacher, else the pre-rank"
    )
    serve.add_argument("--which", action="store_true", help="say what would serve and why; serve nothing")
    serve.add_argument("--model", default=None, help="serve this model URI instead (models:/NAME@ALIAS)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", default="5001")
    summary = sub.add_parser("summary", help="one line: what the last run will serve, and what serves now")
    summary.add_argument("--reporting", default="data/08_reporting", help="the run's reporting folder")
    return parser


def serve(args: argparse.Namespace, client) -> int:  # noqa: ANN001 (an MlflowClient)
    """Say what serves and why, then become `mlflow models serve` on it (unless ``--which``)."""
    from diffusion_gr2.core.registry import registry

    if args.model:
        line = f"serving {args.model} (named on the command line)"
        uri = args.model
    else:
        served = registry.served_champion(client)
        if served.ref is None:
            sys.stderr.write(served.line() + "\n")
            return 1
        line, uri = served.line(), f"models:/{served.ref.name}@{registry.CHAMPION}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if args.which:
        return 0
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "MLFLOW_TRACKING_URI": _store_uri()}
    # --env-manager local: the project's own environment serves the model (nothing is downloaded)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT", "300")
    env |= _request_log_environment(uri, client)
    argv = [str(bin_dir / "mlflow"), "models", "serve", "-m", uri, "--env-manager", "local"]
    os.execve(argv[0], [*argv, "-h", args.host, "-p", str(args.port), "-w", "1"], env)
    return 0  # not reached: the process is now the scoring server


def _request_log_environment(uri: str, client) -> dict[str, str]:  # noqa: ANN001 (an MlflowClient)
    """`serving.request_log` and the version `uri` names now, for the scoring server's workers (they
    load the model without the project's configuration; `core/serving/request_log.py`)."""
    from kedro.config import OmegaConfigLoader

    from diffusion_gr2.core.registry.registry import resolve_uri
    from diffusion_gr2.core.serving.request_log import RequestLogConfig, ServedModel, server_environment
    from diffusion_gr2.settings import CONFIG_LOADER_ARGS

    loader = OmegaConfigLoader("conf", env=os.environ.get("KEDRO_ENV"), **CONFIG_LOADER_ARGS)
    config = RequestLogConfig(**loader["parameters"]["serving"]["request_log"])
    ref = resolve_uri(uri, client)
    return server_environment(config, ServedModel(ref and ref.name, ref and ref.version, uri))


def summary(reporting: str) -> str:
    """The run's last line: whether the served diffusion system has an operating point, what `make
    register` will gate, what serves now. Never fails: a missing report or store is said in the line."""
    from diffusion_gr2.core.base.manifest import read_report
    from diffusion_gr2.core.rank.operating_point import OperatingPointError, resolve_operating_point
    from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
    from diffusion_gr2.core.registry import registry

    path = Path(reporting) / "operating_point.json"
    points = read_report(path)[0] if path.exists() else None
    try:
        tau, window = resolve_operating_point(points, SERVED_DIFFUSION)
        where = "whole block" if window is None else f"window {window}"
        plan = (
            f"{SERVED_DIFFUSION} has an operating point (tau {tau:g}, {where}): "
            "`make register` gates it and the teacher"
        )
    except OperatingPointError as err:
        plan = f"{err}: `make register` gates the teacher ar_rl alone (the pre-rank serves if it fails)"
    try:
        now = registry.served_champion(_mlflow_client()).line()
    except NoStoreError:
        now = "nothing registered yet"
    return f"Will serve: {plan}; now {now}"


def retrain(env: str | None, force: bool, client) -> int:  # noqa: ANN001 (an MlflowClient)
    """Run the retrain pipeline unless there is nothing to retrain (`core.monitoring.retrain_decision`).

    The decision is the one the pipeline's first node makes, asked here first so that "nothing new"
    opens no Kedro session and no MLflow run: the incoming files are still taken in, the decision's
    reason is printed, and nothing is trained or registered (status 0; 1, on stderr, when a delivered
    file was quarantined). A retrain ends with one line: why it ran, the gate's decisions, what serves.
    ``--force`` is ``retrain.force=true``.
    """
    from kedro.config import OmegaConfigLoader
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from diffusion_gr2.core.monitoring.retrain_decision import RetrainConfig, decide_from_params
    from diffusion_gr2.settings import CONFIG_LOADER_ARGS

    # the project's own loader settings (base/local, the `env` resolver), as the Kedro session uses
    loader = OmegaConfigLoader("conf", env=env or os.environ.get("KEDRO_ENV"), **CONFIG_LOADER_ARGS)
    params = loader["parameters"]["retrain"]
    force = force or RetrainConfig.from_params(params).force
    decision = decide_from_params(params, force, client)  # the pipeline's node reads the same
    if not decision.retrain:
        # a delivered file was refused: someone must fix it, so cron and monitors see a failure
        status = 1 if decision.quarantined else 0
        (sys.stderr if status else sys.stdout).write(f"{decision.reason}\n")
        return status
    bootstrap_project(Path.cwd())
    # the pipeline decides again, on the same function: forced there too when forced here
    runtime = {"retrain": {"force": True}} if force else None
    gate_file = Path(loader["catalog"]["gate_report"]["dataset"]["filepath"])
    before = _mtime(gate_file)  # a report this retrain did not write is not its answer
    with KedroSession.create(project_path=Path.cwd(), env=env, runtime_params=runtime) as session:
        session.run(pipeline_names=["retrain"])
    fresh = _mtime(gate_file) not in (None, before)
    sys.stdout.write(retrained_line(decision.reason, gate_file if fresh else None, client) + "\n")
    return 0


def _mtime(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.is_file() else None


GATE_WORDS = {"promote": "promoted", "refuse": "refused", "not_registered": "not registered"}


def retrained_line(reason: str, gate_file: Path | None, client) -> str:  # noqa: ANN001 (an MlflowClient)
    """A finished retrain's answer: why it ran, what the gate did to each re-ranker (`gate_file`: the
    report this retrain wrote, None if none), what serves now. A refusal is an answer too: the
    champion keeps serving, and the status is 0."""
    from diffusion_gr2.core.registry import registry

    serving = registry.served_champion(client).line()
    if gate_file is None:
        return f"retrained ({reason}); this retrain wrote no gate report; {serving}"
    gate = json.loads(gate_file.read_text())
    sides = (
        (registry.DIFFUSION_MODEL, gate, gate.get("challenger_version")),
        (registry.TEACHER_MODEL, gate.get("teacher_gate") or {}, gate.get("teacher_version")),
    )
    words = ", ".join(
        f"{name}{f' v{version}' if version else ''} {GATE_WORDS.get(side.get('decision'), 'not gated')}"
        for name, side, version in sides
    )
    return f"retrained ({reason}); gate: {words} ({gate_file}); {serving}"


def lineage(target: str, client) -> list[str]:  # noqa: ANN001 (an MlflowClient)
    """`lineage_lines` of `target`; a champion alias the model lacks is answered with what does serve
    (the pre-rank or the teacher, when no diffusion model passed the gate), or that nothing does."""
    from diffusion_gr2.core.lineage.lineage_report import lineage_lines
    from diffusion_gr2.core.registry import registry

    try:
        return lineage_lines(client, target, Path.cwd())
    except registry.NotFoundError as err:
        served_models = {f"models:/{name}@{registry.CHAMPION}" for name in registry.SERVING_ORDER}
        if target not in served_models:  # a wrong name or version: the error says which
            raise
        served = registry.served_champion(client).ref
        hint = (
            f"{served.name} v{served.version} serves: `lineage models:/{served.name}@{registry.CHAMPION}`"
            if served
            else "nothing serves yet: run `make register` after `make run`"
        )
        raise registry.NotFoundError(f"{err}; {hint}") from None


def show(name: str | None, client) -> int:  # noqa: ANN001 (an MlflowClient)
    """Every version of `name` (default: the three served models), its aliases, tau and gate decision;
    what serves now as the last line. An empty registry is one line on stderr and status 1."""
    from diffusion_gr2.core.registry import registry

    lines = []
    for model in [name] if name else registry.SERVING_ORDER:
        try:
            rows = registry.version_summary(model, client)
        except registry.NotFoundError:
            if name:
                raise
            continue  # a store may hold some of the three only
        for row in rows:
            aliases = ",".join(row["aliases"]) or "-"
            lines.append(
                f"{model} v{row['version']}  aliases {aliases}  tau {row['tau']}  "
                f"gate {row['gate'] or '-'}  run {row['run_id']}"
            )
    if not lines:
        raise registry.NotFoundError(
            f"the registry at {_store_uri()} holds no version of {', '.join(registry.SERVING_ORDER)}: "
            "run `make register` after `make run`"
        )
    if not name:
        lines.append(registry.served_champion(client).line())
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def ops(argv: list[str]) -> int:
    """Run one operations command; the exit status.

    A model, version, alias or run the store does not hold, and a lineage target of neither form it
    takes, is one line on stderr and status 1: a traceback of MLflow's REST or SQL call (or of the
    URI's parsing) would bury which name was wrong.
    """
    import warnings

    args = _parser().parse_args(argv)
    if args.command == "results":  # reads JSON reports only: no MLflow, torch or Kedro to import
        from diffusion_gr2.core.evaluate.results import MixedRunsError, ResultsError, results_markdown

        try:
            sys.stdout.write(results_markdown(args.reporting, strict=args.strict))
        except (ResultsError, MixedRunsError) as err:
            sys.stderr.write(f"{err}\n")
            return 1
        return 0
    # MLflow warns on import that `RerankerModel.predict` has no type hints (on purpose, see
    # serving.py), past any filter (it sets its own): recorded and dropped, so stderr holds only
    # what a command says
    with warnings.catch_warnings(record=True):
        from diffusion_gr2.core.lineage.lineage_report import MalformedTargetError, check_target
        from diffusion_gr2.core.monitoring.ingest import RetrainLockedError
        from diffusion_gr2.core.registry import registry
    if args.command == "summary":
        sys.stdout.write(summary(args.reporting) + "\n")
        return 0
    try:
        if args.command == "retrain":
            return retrain(args.env, args.force, _mlflow_client(must_exist=False))  # a first retrain makes it
        if args.command == "serve":
            return serve(args, _mlflow_client())
        if args.command == "lineage":
            check_target(args.target)  # before the store is opened: a mistyped target creates no mlflow.db
            lines = lineage(args.target, _mlflow_client())
            sys.stdout.write("\n".join(lines) + "\n")
            return 0
        client = _mlflow_client()
        if args.action == "show" and args.card:
            from diffusion_gr2.core.lineage.model_card import read_card

            sys.stdout.write(read_card(args.name or registry.DIFFUSION_MODEL, args.card, client))
            return 0
        if args.action == "show":
            return show(args.name, client)
        if args.action == "promote":
            ref = registry.promote(args.name, args.version, args.reason, client)
        else:
            ref = registry.rollback(args.name, args.to, args.reason, client)
    except (registry.NotFoundError, MalformedTargetError, NoStoreError, RetrainLockedError) as err:
        sys.stderr.write(f"{err}\n")
        return 1
    sys.stdout.write(f"{ref.name}@{registry.CHAMPION} -> version {ref.version}\n")
    return 0


def _join_launch() -> None:
    """Under ``accelerate launch`` (WORLD_SIZE > 1): join the process group before Kedro starts, with the
    collective timeout (so a hung rank fails the launch instead of hanging it), NCCL on GPUs, gloo on CPUs.
    """
    from diffusion_gr2.runner import launch_size

    if launch_size() == 1:
        return
    import torch
    from accelerate import PartialState

    from diffusion_gr2.core.train.loop import collective_timeout

    cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    PartialState(cpu=cpu, timeout=collective_timeout())


def main(*args, **kwargs) -> None:
    argv = list(args[0]) if args else sys.argv[1:]
    if argv and argv[0] in OPS_COMMANDS:
        raise SystemExit(ops(argv))
    from kedro.framework.cli.utils import find_run_command
    from kedro.framework.project import configure_project

    if argv and argv[0] == "run":  # every process of a launch opens its own KedroSession
        _join_launch()
        argv = argv[1:]
        if not any(a == "--runner" or a.startswith("--runner=") for a in argv):
            argv += ["--runner", "diffusion_gr2.runner.RankAwareRunner"]
        args = (argv, *args[1:])
    package_name = Path(__file__).parent.name
    configure_project(package_name)
    run = find_run_command(package_name)
    run(*args, **kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
