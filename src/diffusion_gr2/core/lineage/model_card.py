"""Model card per registered version (docs/operations.md#retraining, issue 44): what a reviewer reads before a
promotion.

Written at registration, after the gate, from what the runs recorded and nothing else: the version's
tags (operating point, decoding, lineage), the report files of the run that trained the model
(``data_stats.json``, ``training/*.json``, ``stage_metrics.json``, ``operating_point.json``), the raw
files its lineage names with their hashes, and the gate's report. A report file counts as this
model's only when the run that wrote it (the ``lineage.produced.<md5>`` tag of its current content)
is the run that wrote the model folder; otherwise the card says whose it is and leaves its figures
out (a retrain trains and gates without rerunning inference, so the last ``stage_metrics.json`` is an
older model's). The card is Markdown, stored as ``model_card.md`` among the version's model
artifacts and shown by ``python -m diffusion_gr2 registry show NAME --card``.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from diffusion_gr2.core.base.manifest import read_report
from diffusion_gr2.core.data.readers import classify_file, read_interactions
from diffusion_gr2.core.evaluate.tables import markdown_table
from diffusion_gr2.core.lineage.lineage import file_md5
from diffusion_gr2.core.lineage.lineage_report import Lineage, raw_inputs
from diffusion_gr2.core.runs.mlflow_utils import NotFoundError, model_version, version_by_alias

logger = logging.getLogger(__name__)

__all__ = [
    "CARD_FILE",
    "CardConfig",
    "card_facts",
    "publish_card",
    "publish_cards",
    "read_card",
    "render_card",
]

CARD_FILE = "model_card.md"
CARD_TAG = "model_card"  # version tag: the artifact's name, or why no card was written


@dataclass(frozen=True)
class CardConfig:
    """Where the run's report files are (the catalog's paths)."""

    reporting_dir: str = "data/08_reporting"


def _report(path: Path, model_run: str | None, lineage: Lineage) -> dict[str, Any]:
    """One report file: its content when the model's run wrote it, else who did (or that it is absent)."""
    if not path.is_file():
        return {"file": str(path), "status": "absent"}
    digest = file_md5(path)
    writer = lineage.writer(digest)
    entry = {"file": str(path), "md5": digest, "run_id": writer}
    if writer is None or writer != model_run:
        return entry | {"status": f"not this model's (written by run {writer or 'not on record'})"}
    return entry | {"status": "this model's run", "data": read_report(path)[0]}


def _window(raw: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """First and last interaction time and rows of the recorded raw interaction files still on disk."""
    files = [
        Path(v["path"])
        for k, v in raw.items()
        if v["on_disk"] == "ok" and (kind := classify_file(k.removeprefix("raw/"))) and kind[1] == "inter"
    ]
    if not files:
        return None
    stamps = read_interactions(files)["timestamp"]
    first, last = (pd.Timestamp(int(t), unit="s").date().isoformat() for t in (stamps.min(), stamps.max()))
    return {"first": first, "last": last, "rows": len(stamps), "files": len(files)}


def card_facts(
    name: str, version: str, gate: dict[str, Any] | None, client: MlflowClient, config: CardConfig
) -> dict[str, Any]:
    """Everything the card states, each fact with the file or record it came from."""
    mv = model_version(client, name, version)
    tags = dict(mv.tags)
    lineage = Lineage(client, Path.cwd())
    digest = tags.get("lineage.model.digest")
    model_run = lineage.writer(digest) if digest else None
    run_id = model_run or tags.get("lineage.model.run_id") or mv.run_id
    run = client.get_run(run_id) if run_id else None
    folder = Path(config.reporting_dir)
    training = sorted((folder / "training").glob("*.json"))
    raw = {k: v | {"on_disk": lineage.disk_state(v)} for k, v in raw_inputs(client, name, version).items()}
    return {
        "name": name,
        "version": str(version),
        "created": datetime.fromtimestamp(mv.creation_timestamp / 1000, UTC).isoformat(timespec="seconds"),
        "tags": tags,
        "model_run": run_id,
        "commit": (run.data.tags.get("git_commit", "unknown") if run else "unknown"),
        "dirty": (run.data.tags.get("git_dirty") == "true") if run else None,
        "params": {k: v for k, v in (run.data.params if run else {}).items() if k.endswith("max_steps")},
        "raw_files": raw,
        "window": _window(raw),
        "data_stats": _report(folder / "data_stats.json", model_run, lineage),
        "training": {p.stem: _report(p, model_run, lineage) for p in training},
        "stage_metrics": _report(folder / "stage_metrics.json", model_run, lineage),
        "operating_point": _report(folder / "operating_point.json", model_run, lineage),
        "gate": gate,
    }


# ---- rendering ---------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _source(entry: dict[str, Any]) -> str:
    if entry["status"] == "absent":
        return f"_`{entry['file']}` is absent._"
    return f"_Source: `{entry['file']}` (md5 {entry['md5'][:12]}, {entry['status']})._"


def _data_section(facts: dict[str, Any]) -> list[str]:
    lines = ["## Data window and sizes", ""]
    stats = facts["data_stats"]
    if "data" in stats:
        d = stats["data"]
        splits = ", ".join(f"{k} {v}" for k, v in (d.get("splits") or {}).items())
        lines += [
            f"{d.get('users')} users, {d.get('items')} items, {d.get('interactions')} interactions after "
            f"filtering ({d.get('rows_read')} rows read, {d.get('rows_rejected')} rejected); "
            f"median history {d.get('median_history')}; splits: {splits}.",
        ]
    if window := facts.get("window"):
        lines.append(
            f"Window: {window['first']} to {window['last']} ({window['rows']} raw rows in {window['files']} "
            "files, before filtering; read from the lineage's raw files, whose hashes match)."
        )
    else:
        lines.append("Window: not known (no recorded raw file holds its hash on disk).")
    lines += ["", _source(stats), "", "**Lineage head** (raw files the model's data preparation read):", ""]
    raw = facts["raw_files"]
    lines += [f"* `{k}` md5 `{v['digest']}` [{v['on_disk']}] {v['path']}" for k, v in raw.items()] or [
        "* none on record (the version was registered outside a Kedro run, or its runs hold no node records)"
    ]
    return [*lines, ""]


def _training_section(facts: dict[str, Any]) -> list[str]:
    rows, others = [], []
    for stage, entry in facts["training"].items():
        if "data" not in entry:
            others.append(f"`{stage}` ({entry['status']})")
            continue
        d = entry["data"]
        rows.append(
            [
                stage,
                str(d.get("steps")),
                _num(d.get("final_loss"), 4),
                _num(d.get("train_seconds"), 1),
                str(d.get("resumed_from_step", 0)),
            ]
        )
    head = ["stage", "steps run", "final loss", "seconds", "resumed from"]
    lines = ["## Training stages and budgets", "", markdown_table(head, rows)]
    budgets = ", ".join(f"`{k}` {v}" for k, v in sorted(facts["params"].items())) or "none on record"
    lines += ["", f"Budgets (run parameters): {budgets}."]
    if others:
        lines.append(f"Left out, not written by this model's run: {', '.join(others)}.")
    return [*lines, ""]


def _stage_section(facts: dict[str, Any]) -> list[str]:
    lines = ["## Stage table (test split, 95% intervals)", ""]
    entry = facts["stage_metrics"]
    rows = [r for r in entry.get("data") or [] if r.get("split") == "test"]
    if not rows:
        return [*lines, "No stage table for this model: " + _source(entry), ""]
    cells = []
    for r in rows:
        low, high = (r.get("ci") or {}).get("recall@1", [None, None])
        cells.append(
            [
                str(r.get("system")),
                _num(r.get("tau"), 2),
                str(r.get("n")),
                f"{_num(r.get('recall@1'))} [{_num(low)}, {_num(high)}]",
                _num(r.get("unforced_rate")),
                _num(r.get("valid_rate")),
            ]
        )
    head = ["system", "tau", "n", "R@1 [95%]", "own valid", "served valid"]
    lines.append(markdown_table(head, cells))
    return [*lines, "", _source(entry), ""]


def _operating_section(facts: dict[str, Any]) -> list[str]:
    tags, entry = facts["tags"], facts["operating_point"]
    lines = [
        "## Operating point",
        "",
        f"Served at tau {tags.get('operating_point.tau', '-')}, window {tags.get('operating_point.window', '-')} "
        f"(source: {tags.get('operating_point.source', '-')}).",
    ]
    chosen = (entry.get("data") or {}).get(tags.get("system", ""))
    if isinstance(chosen, dict):
        rule = {k: v for k, v in chosen.items() if not isinstance(v, list | dict)}
        lines.append("Rule and choice on validation: " + ", ".join(f"{k} {v}" for k, v in rule.items()) + ".")
    decoding = ", ".join(
        f"{k.removeprefix('decoding.')} {v}" for k, v in tags.items() if k.startswith("decoding.")
    )
    lines += [f"Decoding: {decoding or '-'}.", "", _source(entry), ""]
    return lines


def _gate_section(facts: dict[str, Any]) -> list[str]:
    gate = facts["gate"]
    if gate is None:
        return ["## Gate", "", "Not gated when this card was written.", ""]
    n = gate.get("numbers") or {}
    lines = [
        "## Speed",
        "",
        f"Speed-up over the AR teacher at batch 1: {_num(n.get('speed_ratio_vs_ar_rl'), 2)}x, interval "
        f"[{_num(n.get('speed_ratio_vs_ar_rl.low'), 2)}, {_num(n.get('speed_ratio_vs_ar_rl.high'), 2)}] "
        f"({_num(n.get('speed_ratio_vs_ar_rl.coverage'), 2)} coverage, {_num(n.get('speed_ratio_vs_ar_rl.rounds'), 0)} "
        f"rounds) on {facts.get('machine', 'an unrecorded machine')}.",
        "",
        f"## Gate: {gate.get('decision')}",
        "",
        f"On {n.get('n_requests', '-')} requests. {gate.get('reasons', '')}",
        "",
    ]
    checks = [
        [c["name"], _num(c["value"], 4), _num(c["threshold"], 4), "yes" if c["passed"] else "NO"]
        for c in gate.get("checks") or []
    ]
    lines.append(markdown_table(["check", "value", "threshold", "passed"], checks))
    return [*lines, ""]


def _limits_section(facts: dict[str, Any]) -> list[str]:
    n = (facts["gate"] or {}).get("numbers") or {}
    own = n.get("unforced_rate")
    low, high = n.get("recall@1_vs_prerank.low"), n.get("recall@1_vs_prerank.high")
    versus = (
        f"its paired R@1 difference to the retriever's own order is [{_num(low)}, {_num(high)}]"
        + (", an interval that holds 0: on these requests it is not shown to beat the pre-rank" if
           low is not None and high is not None and low <= 0 <= high else "")
    )  # fmt: skip
    return [
        "## Intended use and limits",
        "",
        "* Use: re-rank a short candidate list (the retriever's top items, raw item ids) for one user from "
        "their history, with a short explanation; served under the answer grammar, so every served "
        "answer is a valid ranking.",
        "* Information limit: MovieLens-100k has ~1k users and ~1.7k items; with 10 candidates R@1 sits "
        "near 0.15 and a gate slice of a few hundred requests resolves differences no finer than its "
        f"margin. Gate figures: {versus}.",
        f"* Own validity: without the grammar {_num(own)} of its answers are valid rankings (the gate's "
        "floor is the `unforced_rate` check); do not serve it without the grammar.",
        "* Not for: catalogues or users outside the item catalogue it was registered with (unknown "
        "history items are left out of the prompt, unknown candidates are refused), nor data unlike "
        "the window above (see the retrain's drift report).",
        "",
    ]


def render_card(facts: dict[str, Any]) -> str:
    """The card as Markdown (pure: everything comes from `facts`)."""
    tags = facts["tags"]
    dirty = " (uncommitted changes)" if facts.get("dirty") else ""
    head = [
        f"# Model card: {facts['name']} version {facts['version']}",
        "",
        f"System `{tags.get('system', '?')}`, registered {facts['created']}; trained by run "
        f"`{facts['model_run']}` at commit `{str(facts['commit'])[:12]}`{dirty}; model folder md5 "
        f"`{tags.get('lineage.model.digest', '-')}`"
        + (f"; teacher version {tags['teacher_version']}" if "teacher_version" in tags else "")
        + ".",
        "",
    ]
    sections = (_data_section, _training_section, _stage_section, _operating_section, _gate_section)
    body = [line for section in sections for line in section(facts)]
    return "\n".join(head + body + _limits_section(facts))


# ---- storing and reading -----------------------------------------------------------------------------


def _model_id(mv: Any) -> str:
    """The LoggedModel behind a version: its ``model_id``, or the id its ``models:/m-...`` source names."""
    if getattr(mv, "model_id", None):
        return mv.model_id
    source = str(mv.source or "")
    if source.startswith("models:/m-"):
        return source.removeprefix("models:/").split("/")[0]
    raise NotFoundError(f"{mv.name} version {mv.version} names no logged model (source {source!r})")


def publish_card(
    name: str, version: str, gate: dict[str, Any] | None, client: MlflowClient, config: CardConfig
) -> str:
    """Write the card of `name` `version` among its model artifacts (and tag the version); the card."""
    from diffusion_gr2.core.lineage.lineage import machine

    facts = card_facts(name, version, gate, client, config)
    timing = machine()
    facts["machine"] = (
        f"{timing['cpu_cores']} CPU cores, {timing['torch_threads']} torch threads, "
        f"{timing['gpu'] or 'no GPU'} (the machine that ran the gate)"
    )
    text = render_card(facts)
    mv = model_version(client, name, version)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / CARD_FILE
        path.write_text(text)
        client.log_model_artifact(_model_id(mv), str(path))
    client.set_model_version_tag(name, str(version), CARD_TAG, CARD_FILE)
    logger.info("model card of %s v%s written (%d lines)", name, version, text.count("\n") + 1)
    return text


def publish_cards(
    gate_result: dict[str, Any], client: MlflowClient | None = None, config: CardConfig | None = None
) -> dict[str, str]:
    """A card for each version the gate judged (diffusion model and teacher), with its own gate's report.

    A card that cannot be written is logged and tagged on the version with the reason: the gate's
    decision and the promotion stand either way.
    """
    from diffusion_gr2.core.registry import registry

    client, config = client or MlflowClient(), config or CardConfig()
    judged = {
        registry.DIFFUSION_MODEL: (gate_result.get("challenger_version"), gate_result),
        registry.TEACHER_MODEL: (gate_result.get("teacher_version"), gate_result.get("teacher_gate")),
    }
    written = {}
    for name, (version, gate) in judged.items():
        if version is None:
            continue
        try:
            written[name] = publish_card(name, str(version), gate, client, config)
        except Exception as err:  # the card is a record of the gate; never a reason to undo it
            logger.exception("no model card for %s v%s", name, version)
            client.set_model_version_tag(name, str(version), CARD_TAG, f"not written: {err}"[:5000])
    return written


def read_card(name: str, which: str, client: MlflowClient | None = None) -> str:
    """The stored card of `name` at version or alias `which`; `NotFoundError` saying why there is none."""
    client = client or MlflowClient()
    try:
        mv = model_version(client, name, which) if which.isdigit() else version_by_alias(client, name, which)
    except NotFoundError as err:  # e.g. no champion after a refused gate: the challenger's card is there
        raise NotFoundError(
            f"{err}; read a version's card with `python -m diffusion_gr2 registry show {name} --card "
            "VERSION_OR_ALIAS`"
        ) from err
    with tempfile.TemporaryDirectory() as tmp:
        try:
            uri = f"models:/{name}/{mv.version}/{CARD_FILE}"
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp)).read_text()
        except (OSError, MlflowException) as err:
            why = mv.tags.get(CARD_TAG, "registered before model cards existed, or never gated")
            raise NotFoundError(f"{name} version {mv.version} has no model card ({why})") from err
