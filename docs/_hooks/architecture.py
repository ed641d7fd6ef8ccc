"""mkdocs hook: draw the package's layers and the imports between its modules, read from source.

The picture in docs/architecture.md is this package as it is at build time: every module of
``functional_shard/`` and ``adapters/`` (installed as ``functional_shard.adapters``) is read
with ``ast`` (nothing is imported, nothing runs) and drawn as a box in its layer's band,
core at the bottom, adapters on top; each import between two modules is a line, imports
inside functions and under ``if TYPE_CHECKING:`` included. Modules appear, move and vanish
with the code; only the order of the layers is written here. An import that points up a
layer is drawn red. ``fs.name`` and ``from functional_shard import name`` count as imports
of the module the façade loads for ``name``; such a reference that climbs a layer (a method
whose work lives above, reaching it through the façade) is drawn dashed, named.

The PNG goes to ``docs/generated/architecture.png`` (git-ignored), rewritten only when its
bytes change. Run alone to draw it and print the graph:
``python3 docs/_hooks/architecture.py [picture.png]``.
"""

from __future__ import annotations

import ast
import functools
import io
import math
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).parents[2]
PACKAGE = "functional_shard"
# the house rule (issue #21): a module imports from its own layer or the ones below
LAYERS = ("core", "planning", "costing", "search", "runtime", "frontends", "adapters")
PICTURE = "architecture.png"

# geometry, in inches
WIDTH = 15.0
MARGIN = 1.7  # left of the bands: the façade's bar and the layers' names
BOX_WIDTH, BOX_HEIGHT, ROW_HEIGHT = 1.45, 0.38, 0.52
BAND_TOP, BAND_GAP = 0.42, 0.5  # room for a band's summary line; between bands


@dataclass(frozen=True)
class Module:
    """One module of the package, as the picture needs it."""

    name: str  # dotted, as installed: functional_shard.runtime.engines.pipeline
    path: pathlib.Path
    layer: str  # one of LAYERS, "façade", or the subpackage's name when it is no known layer
    label: str  # its name inside its layer: engines.pipeline
    lines: int
    summary: str  # its docstring's first line


@dataclass(frozen=True)
class Band:
    """One layer's strip of the picture: its modules in order, left to right, in zigzag rows."""

    layer: str
    names: tuple[str, ...]
    rows: int
    bottom: float
    height: float


@dataclass(frozen=True)
class Layout:
    """Where everything goes: the bands bottom up, each module's centre, the figure's height."""

    bands: tuple[Band, ...]
    centre: dict[str, tuple[float, float]]
    row: dict[str, int]
    height: float


# ---- reading the package -------------------------------------------------------------


def read_modules(root: pathlib.Path = ROOT) -> dict[str, Module]:
    """Every module of the two source folders, by installed name.

    ``rglob`` does not enter a symlinked folder (a development worktree links
    functional_shard/adapters to ../adapters), so each module is read once.
    """
    folders = {root / PACKAGE: PACKAGE, root / "adapters": f"{PACKAGE}.adapters"}
    modules = {}
    for folder, package in folders.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if "__pycache__" in relative.parts:
                continue
            parts = relative.with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            name = ".".join((package, *parts))
            layer, label = _place(name)
            text = path.read_text()
            docstring = ast.get_docstring(_parsed(text)[0]) or ""
            summary = docstring.split("\n")[0].replace("``", "").replace("`", "")
            modules[name] = Module(name, path, layer, label, len(text.splitlines()), summary)
    return modules


@functools.lru_cache(maxsize=512)  # bounded: ``mkdocs serve`` adds an entry per edit
def _parsed(text: str) -> tuple[ast.Module, tuple[ast.AST, ...]]:
    """A module's tree and every node in it, parsed once however often the picture asks.

    Keyed by the text, not the path: under ``mkdocs serve`` an edited file is parsed anew.
    """
    tree = ast.parse(text)
    return tree, tuple(ast.walk(tree))


def _place(name: str) -> tuple[str, str]:
    parts = name.split(".")[1:]
    if not parts:
        return "façade", PACKAGE
    if parts[0] == "adapters":
        return "adapters", ".".join(parts[1:]) or "adapters"
    if len(parts) == 1 and parts[0] not in LAYERS:  # cli.py, zoo.py, __main__.py: old paths kept
        return "frontends", f"{PACKAGE}.{parts[0]}"
    return parts[0], ".".join(parts[1:]) or parts[0]


def is_note(module: Module) -> bool:
    """A package ``__init__`` that holds only its docstring: a folder's note, not a box."""
    if module.path.name != "__init__.py":
        return False
    body = _parsed(module.path.read_text())[0].body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def exports(modules: dict[str, Module]) -> dict[str, str]:
    """The façade's one list (`_DEFINITIONS`, a literal): public name -> the module it loads."""
    for node in _parsed(modules[PACKAGE].path.read_text())[1]:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_DEFINITIONS":
            found = {}
            for module, names in ast.literal_eval(node.value).items():
                for defined, _, given in (name.partition(" as ") for name in names):
                    whole = f"{PACKAGE}.{module}.{defined}"  # a submodule given whole (fs.checkpoint)
                    found[given or defined] = whole if whole in modules else f"{PACKAGE}.{module}"
            return found
    return {}


def imports(module: Module, modules: dict[str, Module], exported: dict[str, str]) -> set[str]:
    """The modules of the package that ``module`` imports, anywhere in its source."""
    direct, through = _references(module, modules, exported)
    return direct | set(through)


def _known(target: str, module: Module, modules: dict[str, Module]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target if target and target not in (module.name, PACKAGE) else None


def _references(
    module: Module, modules: dict[str, Module], exported: dict[str, str]
) -> tuple[set[str], dict[str, str]]:
    """What ``module`` imports by name, and what it reaches through the façade (module -> fs.name)."""
    nodes = _parsed(module.path.read_text())[1]
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    facades, targets, through = set(), set(), {}
    for node in nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            facades.update(alias.asname or PACKAGE for alias in node.names if alias.name == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    targets.add(f"{base}.{alias.name}")
                else:
                    targets.add(exported.get(alias.name, base) if base == PACKAGE else base)
    for node in nodes:  # fs.apply where `import functional_shard as fs`
        if (
            isinstance(node, ast.Attribute)
            and getattr(node.value, "id", None) in facades
            and (target := _known(exported.get(node.attr, PACKAGE), module, modules)) is not None
        ):
            named = {*through.get(target, "").split(", "), f"fs.{node.attr}"} - {""}
            through[target] = ", ".join(sorted(named))
    direct = {found for target in targets if (found := _known(target, module, modules)) is not None}
    return direct, {target: name for target, name in through.items() if target not in direct}


def climbs(modules: dict[str, Module]) -> dict[tuple[str, str], str]:
    """The references up a layer made only through the façade: (module, target) -> ``fs.name``.

    A method of a lower layer's data whose work lives above (``plan.cost()``) reaches it so.
    """
    exported = exports(modules)
    found = {}
    for name, module in modules.items():
        if name == PACKAGE:
            continue
        for target, through in _references(module, modules, exported)[1].items():
            if rank(modules[target].layer) > rank(module.layer):
                found[(name, target)] = through
    return found


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the modules it imports; the façade, which sees every layer, left out."""
    exported = exports(modules)
    return {name: imports(module, modules, exported) for name, module in modules.items() if name != PACKAGE}


def rank(layer: str) -> int:
    """A layer's height: LAYERS in order; a subpackage that is no known layer above them all."""
    return LAYERS.index(layer) if layer in LAYERS else len(LAYERS)


def upward(modules: dict[str, Module], graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that point up a layer (the house rule forbids them)."""
    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if rank(modules[target].layer) > rank(modules[name].layer)
    )


def drawn_graph(modules: dict[str, Module]) -> tuple[dict[str, Module], dict[str, set[str]]]:
    """The modules drawn as boxes (not the façade, not a folder's note) and the imports between them."""
    graph = import_graph(modules)
    boxes = {name: module for name, module in modules.items() if name != PACKAGE and not is_note(module)}
    drawn = {name: {target for target in graph[name] if target in boxes} for name in boxes}
    return boxes, drawn


# ---- placing it ----------------------------------------------------------------------


def _ordered_bands(boxes: dict[str, Module], graph: dict[str, set[str]]) -> list[list[str]]:
    """The boxes of each layer, bottom up, ordered so that lines cross little.

    Barycentre ordering (Sugiyama): a few sweeps up and down, each band sorted by the mean
    position of the modules it imports (going up) or of those that import it (going down).
    """
    layers = sorted({module.layer for module in boxes.values()}, key=lambda layer: (rank(layer), layer))
    bands = [sorted(name for name, module in boxes.items() if module.layer == layer) for layer in layers]
    importers: dict[str, set[str]] = {name: set() for name in boxes}
    for name, targets in graph.items():
        for target in targets:
            importers.setdefault(target, set()).add(name)
    for _ in range(4):
        for indices, neighbours in (
            (range(1, len(bands)), graph),
            (range(len(bands) - 2, -1, -1), importers),
        ):
            for index in indices:
                at = {name: (i + 0.5) / len(band) for band in bands for i, name in enumerate(band)}
                bands[index].sort(key=lambda name, at=at, ns=neighbours: _mean(name, at, ns))  # type: ignore[misc]
    return bands


def _mean(name: str, at: dict[str, float], neighbours: dict[str, set[str]]) -> float:
    linked = [at[other] for other in neighbours.get(name, ()) if other in at]
    return sum(linked) / len(linked) if linked else at[name]


def layout(boxes: dict[str, Module], graph: dict[str, set[str]]) -> Layout:
    """Bands bottom up, each as many zigzag rows as its boxes need: the order along x is kept."""
    usable = WIDTH - MARGIN - 0.3
    per_row = max(1, int(usable / (BOX_WIDTH * 1.08)))
    bands, centre, row = [], {}, {}
    bottom = 1.1  # the legend below
    for names in _ordered_bands(boxes, graph):
        rows = max(1, math.ceil(len(names) / per_row))
        height = rows * ROW_HEIGHT + BAND_TOP + 0.1
        spacing = (usable - BOX_WIDTH) / max(1, len(names) - 1)
        for i, name in enumerate(names):
            row[name] = i % rows
            x = MARGIN + BOX_WIDTH / 2 + i * spacing if len(names) > 1 else MARGIN + usable / 2
            centre[name] = (x, bottom + 0.1 + (rows - row[name] - 0.5) * ROW_HEIGHT)
        bands.append(Band(boxes[names[0]].layer, tuple(names), rows, bottom, height))
        bottom += height + BAND_GAP
    return Layout(tuple(bands), centre, row, bottom - BAND_GAP + 0.9)


# ---- drawing it ----------------------------------------------------------------------


def draw_figure(root: pathlib.Path = ROOT) -> Any:
    """The picture of the package under ``root``: layers as bands, modules as boxes, imports as lines."""
    import matplotlib.pyplot as plt

    modules = read_modules(root)
    boxes, drawn = drawn_graph(modules)
    place = layout(boxes, drawn)
    figure = plt.figure(figsize=(WIDTH, place.height))
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(0, WIDTH)
    axes.set_ylim(0, place.height)
    axes.axis("off")
    _draw_bands(axes, place, modules)
    climbing = climbs(modules)
    _draw_imports(axes, place, boxes, drawn, climbing)
    _draw_facade(axes, place, sum(not name.startswith("_") for name in exports(modules)))
    edges = sum(len(targets) for targets in drawn.values())
    lines = sum(module.lines for module in modules.values())
    axes.text(
        MARGIN - 0.1,
        place.height - 0.25,
        f"{PACKAGE}: {len(boxes)} modules in {len(place.bands)} layers, {lines:,} lines, "
        f"{edges} imports between modules",
        fontsize=12,
        fontweight="bold",
        va="top",
    )
    axes.text(
        MARGIN - 0.1,
        place.height - 0.55,
        "drawn from the source at each docs build by docs/_hooks/architecture.py",
        fontsize=9,
        color="dimgray",
        va="top",
    )
    legend = (
        "grey line: an import down a layer     blue: an import within a layer     "
        f"red arrow: an import up a layer (the house rule forbids it; "
        f"{len(set(upward(boxes, drawn)) - set(climbing))} now)\n"
        "dashed purple: a method whose work lives a layer above, reaching it through the façade (fs.name)"
        "     thick border: a module in a sub-folder (engines/, cli/)     small number: its lines"
    )
    axes.text(MARGIN - 0.1, 0.55, legend, fontsize=8.5, va="center", color="dimgray", linespacing=1.6)
    return figure


def _draw_bands(axes: Any, place: Layout, modules: dict[str, Module]) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    colours = plt.get_cmap("Pastel1").colors
    usable = WIDTH - MARGIN - 0.3
    for band in place.bands:
        colour = colours[rank(band.layer) % len(colours)]
        axes.add_patch(
            FancyBboxPatch(
                (MARGIN - 0.1, band.bottom),
                usable + 0.2,
                band.height,
                boxstyle="round,pad=0.02",
                facecolor=colour,
                alpha=0.45,
                edgecolor="none",
                zorder=0,
            )
        )
        lines = sum(modules[name].lines for name in band.names)
        known = "" if band.layer in LAYERS else "\n(no known layer)"
        axes.text(
            MARGIN - 0.2,
            band.bottom + band.height / 2,
            f"{band.layer}{known}\n{len(band.names)} modules\n{lines:,} lines",
            ha="right",
            va="center",
            fontsize=10,
            fontweight="bold",
        )
        package = modules.get(f"{PACKAGE}.{band.layer}") or modules.get(f"{PACKAGE}.adapters")
        if package is not None and package.layer == band.layer:  # the layer's own docstring
            axes.text(
                MARGIN,
                band.bottom + band.height - 0.08,
                package.summary,
                fontsize=8,
                style="italic",
                va="top",
                color="dimgray",
            )
        for name in band.names:
            _draw_box(axes, place.centre[name], modules[name])


def _draw_box(axes: Any, centre: tuple[float, float], module: Module) -> None:
    from matplotlib.patches import FancyBboxPatch

    x, y = centre
    nested = "." in module.label and not module.label.startswith(PACKAGE)
    axes.add_patch(
        FancyBboxPatch(
            (x - BOX_WIDTH / 2, y - BOX_HEIGHT / 2),
            BOX_WIDTH,
            BOX_HEIGHT,
            boxstyle="round,pad=0.01",
            facecolor="white",
            edgecolor="dimgray",
            linewidth=1.6 if nested else 0.8,
            zorder=3,
        )
    )
    size = 7.5 if len(module.label) <= 22 else 7.5 * 22 / len(module.label)  # long names still fit
    axes.text(x, y + 0.06, module.label, ha="center", va="center", fontsize=size, zorder=4)
    axes.text(x, y - 0.1, str(module.lines), ha="center", va="center", fontsize=6, color="gray", zorder=4)


def _draw_imports(
    axes: Any,
    place: Layout,
    boxes: dict[str, Module],
    graph: dict[str, set[str]],
    climbing: dict[tuple[str, str], str],
) -> None:
    from matplotlib.patches import FancyArrowPatch, PathPatch
    from matplotlib.path import Path

    top = BOX_HEIGHT / 2
    for name, targets in graph.items():
        for target in sorted(targets):
            (x0, y0), (x1, y1) = place.centre[name], place.centre[target]
            here, there = rank(boxes[name].layer), rank(boxes[target].layer)
            if (name, target) in climbing:
                _draw_climb(axes, (x0, y0 + top), (x1, y1 - top), climbing[name, target])
            elif there > here:  # up a layer: the one kind the house forbids
                arrow = FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12)
                arrow.set(color="red", linewidth=1.8, zorder=5)
                axes.add_patch(arrow)
            elif there < here:
                axes.plot([x0, x1], [y0 - top, y1 + top], color="black", alpha=0.13, linewidth=0.6, zorder=1)
            elif place.row[name] == place.row[target]:  # same row: a low arch over the boxes between
                lift = min(0.22, 0.04 * abs(x1 - x0)) + 0.02
                path = Path([(x0, y0 + top), ((x0 + x1) / 2, y0 + top + 2 * lift), (x1, y1 + top)], [1, 3, 3])
                axes.add_patch(
                    PathPatch(path, fill=False, color="tab:blue", alpha=0.3, linewidth=0.6, zorder=2)
                )
            else:
                axes.plot([x0, x1], [y0, y1], color="tab:blue", alpha=0.3, linewidth=0.6, zorder=2)


def _draw_climb(axes: Any, start: tuple[float, float], end: tuple[float, float], label: str) -> None:
    from matplotlib.patches import FancyArrowPatch

    arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, connectionstyle="arc3,rad=0.12")
    arrow.set(color="tab:purple", linestyle="--", linewidth=1.2, zorder=5)
    axes.add_patch(arrow)
    axes.text(
        end[0],
        end[1] - 0.04,
        label,
        ha="center",
        va="top",
        fontsize=7,
        color="tab:purple",
        zorder=6,
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.8},
    )


def _draw_facade(axes: Any, place: Layout, exported: int) -> None:
    from matplotlib.patches import FancyBboxPatch

    bottom = place.bands[0].bottom
    top = place.bands[-1].bottom + place.bands[-1].height
    axes.add_patch(
        FancyBboxPatch(
            (0.12, bottom),
            0.34,
            top - bottom,
            boxstyle="round,pad=0.02",
            facecolor="lightsteelblue",
            edgecolor="dimgray",
            linewidth=0.8,
        )
    )
    axes.text(
        0.29,
        (bottom + top) / 2,
        f"the façade, {PACKAGE}/__init__.py: {exported} public names from every layer, each loaded "
        "on first use (PEP 562); a method whose work lives above reaches it here",
        rotation=90,
        ha="center",
        va="center",
        fontsize=8.5,
    )


# ---- writing it ----------------------------------------------------------------------


def draw(folder: pathlib.Path, root: pathlib.Path = ROOT) -> bool:
    """Write the picture into ``folder``; returns whether its bytes changed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    folder.mkdir(parents=True, exist_ok=True)
    figure = draw_figure(root)
    drawn = io.BytesIO()
    # no timestamps or software versions in the file: the same code gives the same bytes
    figure.savefig(drawn, format="png", dpi=110, metadata={"Software": None})
    plt.close(figure)
    # 256 colours: a third of the bytes (antialiased lines make a million shades of grey)
    buffer = io.BytesIO()
    image = (
        Image.open(drawn)
        .convert("RGB")
        .quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    )
    image.save(buffer, format="png", optimize=True)
    target = folder / PICTURE
    if target.exists() and target.read_bytes() == buffer.getvalue():
        return False
    target.write_bytes(buffer.getvalue())
    return True


def on_pre_build(config: Any) -> None:
    """Before mkdocs reads ``docs/``: draw the package into ``docs/generated/``."""
    draw(pathlib.Path(config["docs_dir"]) / "generated")


def main() -> int:
    """Draw the picture (into ``argv[1]`` if given) and print the layers and any upward import."""
    picture = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "generated" / PICTURE
    draw(picture.parent)
    if picture.name != PICTURE:
        (picture.parent / PICTURE).replace(picture)
    modules = read_modules()
    boxes, drawn = drawn_graph(modules)
    for band in layout(boxes, drawn).bands:
        labels = ", ".join(modules[name].label for name in band.names)
        print(f"{band.layer:<10} {len(band.names):>3} modules: {labels}")
    climbing = climbs(modules)
    up = [edge for edge in upward(boxes, drawn) if edge not in climbing]
    print(f"{sum(map(len, drawn.values()))} imports, {len(up)} up a layer")
    for name, target in up:
        print(f"  {name} -> {target}")
    for (name, target), through in sorted(climbing.items()):
        print(f"  through the façade: {name} -> {target} ({through})")
    print(f"wrote {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
