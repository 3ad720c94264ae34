"""Reader for RecBole atomic files (``.inter`` and ``.item``) and the MovieLens-100k copy in its wheel.

Atomic files are tab-separated with a typed header, e.g. ``user_id:token  item_id:token
rating:float  timestamp:float``; ``token_seq`` values are space-separated lists. Item files vary per
dataset (ml-100k: ``item_id movie_title:token_seq release_year:token class:token_seq``), so columns
are matched by name and the ones without a place in the items frame are kept in its description.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from diffusion_gr2.core.data.raw import (
    DataQualityError,
    InteractionRow,
    ItemRow,
    RawDataset,
    ReadConfig,
    RejectRow,
    Rejects,
    build_raw_dataset,
    collect_item_rows,
    item_row,
    iter_lines,
    parse_id,
    parse_lines,
    parse_rating,
    parse_timestamp,
)

EMBEDDED_DATASET = "ml-100k"
TITLE_FIELDS = ("title", "movie_title", "item_name", "name")
CATEGORY_FIELDS = ("categories", "category", "class", "genre", "genres")
DESCRIPTION_FIELDS = ("description", "desc")


def embedded_ml100k_folder() -> Path:
    """The ``dataset_example/ml-100k`` folder of the installed ``recbole`` wheel.

    Located with ``find_spec`` so that recbole itself (and its unwanted dependencies) is never imported.
    """
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded MovieLens-100k needs the recbole wheel: pip install --no-deps recbole==1.2.1 "
            "(or put ml-100k.inter/ml-100k.item under data/01_raw/ml-100k/)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / EMBEDDED_DATASET
    if not (folder / f"{EMBEDDED_DATASET}.inter").is_file():
        raise FileNotFoundError(f"recbole is installed but {folder} holds no {EMBEDDED_DATASET}.inter")
    return folder


def parse_header(path: Path, text: str, required: tuple[str, ...]) -> list[tuple[str, str]]:
    """``[(name, type), ...]`` from a typed header line; a missing required column stops the run."""
    columns = [tuple(part.split(":", 1)) if ":" in part else (part, "token") for part in text.split("\t")]
    names = [name.strip() for name, _ in columns]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise DataQualityError(f"{path}: line 1 header {text!r} names column(s) {repeated} more than once")
    missing = [name for name in required if name not in names]
    if missing:
        raise DataQualityError(
            f"{path}: line 1 header {text!r} lacks column(s) {missing}; RecBole atomic files need "
            f"{list(required)} (typed as name:type, tab-separated)"
        )
    return [(name.strip(), kind.strip()) for name, kind in columns]


def split_fields(text: str, width: int) -> list[str]:
    """Tab-separated cells of one data line; a wrong cell count rejects it."""
    cells = text.split("\t")
    if len(cells) != width:
        raise RejectRow("malformed_line")
    return cells


def parse_inter_line(
    cells: list[str], index: dict[str, int], config: ReadConfig
) -> tuple[str, str, int, float]:
    """One interaction from the cells of an ``.inter`` line (rating NaN when the file has none)."""
    user = parse_id(cells[index["user_id"]], "user_id")
    item = parse_id(cells[index["item_id"]], "item_id")
    stamp = cells[index["timestamp"]].strip()
    if not stamp:
        raise RejectRow("missing_field:timestamp")
    timestamp = parse_timestamp(stamp)
    rating = math.nan
    if "rating" in index:
        value = cells[index["rating"]].strip()
        if not value:
            raise RejectRow("missing_field:rating")
        rating = parse_rating(value, config)
    return user, item, timestamp, rating


def read_inter_file(
    path: Path, config: ReadConfig, rejects: Rejects, known_items: set[str] | None
) -> list[InteractionRow]:
    """Interactions of one ``.inter`` file; ``known_items`` (when an item file exists) rejects unknown items."""
    lines = iter_lines(path, rejects, has_header=True)
    header = next(lines, None)
    if header is None:
        return []
    columns = parse_header(path, header[1], ("user_id", "item_id", "timestamp"))
    index = {name: position for position, (name, _) in enumerate(columns)}

    def parse(text: str) -> InteractionRow:
        row = parse_inter_line(split_fields(text, len(columns)), index, config)
        if known_items is not None and row[1] not in known_items:
            raise RejectRow("unknown_item")
        return row

    return parse_lines(path, lines, parse, rejects)


def item_roles(columns: list[tuple[str, str]]) -> dict[str, str]:
    """Map each item-file column to its role: title, categories, brand, price, description or extra."""

    def first(candidates: tuple[str, ...]) -> str | None:
        names = [name for name, _ in columns]
        return next((name for name in candidates if name in names), None)

    roles = {name: "extra" for name, _ in columns if name != "item_id"}
    title = first(TITLE_FIELDS) or next((name for name, _ in columns if "title" in name), None)
    for role, name in (
        ("title", title),
        ("categories", first(CATEGORY_FIELDS)),
        ("brand", first(("brand", "store"))),
        ("price", first(("price",))),
        ("description", first(DESCRIPTION_FIELDS)),
    ):
        if name is not None:
            roles[name] = role
    return roles


def parse_item_line(cells: list[str], columns: list[tuple[str, str]], roles: dict[str, str]) -> ItemRow:
    """One normalised item from an ``.item`` line; unplaced columns become ``name: value`` text."""
    fields = {role: "" for role in ("title", "categories", "brand", "price", "description")}
    kinds = dict(columns)
    extras: list[str] = []
    item_id = ""
    for (name, _), cell in zip(columns, cells, strict=True):
        value = cell.strip()
        if name == "item_id":
            item_id = parse_id(value, "item_id")
        elif roles[name] == "extra":
            extras.append(f"{name}: {value}" if value else "")
        else:
            fields[roles[name]] = value
    cat_text = fields["categories"]
    cat_kind = kinds.get(next((n for n, r in roles.items() if r == "categories"), ""), "token")
    categories = cat_text.split() if cat_kind.endswith("_seq") else ([cat_text] if cat_text else [])
    description = " ".join(part for part in [fields["description"], *extras] if part)
    return item_row(
        item_id,
        fields["title"],
        list(dict.fromkeys(categories)),
        fields["brand"],
        fields["price"],
        description,
    )


def read_item_file(path: Path, rejects: Rejects, seen: set[str]) -> list[ItemRow]:
    """Normalised items of one ``.item`` file; repeated item ids after the first are rejected."""
    lines = iter_lines(path, rejects, has_header=True)
    header = next(lines, None)
    if header is None:
        return []
    columns = parse_header(path, header[1], ("item_id",))
    roles = item_roles(columns)
    return collect_item_rows(
        path,
        lines,
        lambda text: parse_item_line(split_fields(text, len(columns)), columns, roles),
        rejects,
        seen,
    )


def read_recbole(
    inter_files: list[Path], item_files: list[Path], config: ReadConfig, source: Path
) -> RawDataset:
    """Read RecBole atomic files: every ``.inter`` (interactions) and ``.item`` (metadata) given."""
    rejects = Rejects()
    seen: set[str] = set()
    items: list[ItemRow] = []
    for path in item_files:
        items.extend(read_item_file(path, rejects, seen))
    known = seen if item_files else None
    interactions: list[InteractionRow] = []
    for path in inter_files:
        interactions.extend(read_inter_file(path, config, rejects, known))
    return build_raw_dataset(interactions, items, rejects, "recbole", source, has_metadata=bool(item_files))
