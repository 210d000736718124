"""The closed vocabulary of the shapes world: GenEval's colour names and tags, the shapes, the wording rules.

Design and measured thresholds: ../shared docs SHAPES_BENCHMARK.md §4.2 (colours, shapes, sizes).
Prompt wording follows GenEval's `prompts/create_prompts.py` (article rule, plural rule, templates), so the
prompt text of a shapes record reads exactly like a GenEval prompt with a shape in place of a COCO class.
"""

from __future__ import annotations

from dataclasses import dataclass

# GenEval's 10 colour names (create_prompts.py order) with well separated canonical RGB values.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (255, 140, 0),
    "yellow": (250, 230, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "purple": (130, 40, 180),
    "pink": (255, 150, 200),
    "brown": (120, 70, 30),
    "black": (15, 15, 15),
    "white": (245, 245, 245),
}
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)

# Mid-gray background: outside the palette, and both black and white objects stay visible.
BACKGROUND: tuple[int, int, int] = (128, 128, 128)

# GenEval's six tags, in its order.
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
NUMBER_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}

ALL_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "diamond")


@dataclass(frozen=True)
class World:
    """One resolution of the shapes world.

    Attributes:
        resolution: image side in pixels (square images).
        shapes: the shape names used at this resolution (32×32: 4 shapes; 64×64 adds diamond, §4.2).
        size_range: (min, max) half-size in pixels of an object (its box is 2·s wide).
        size_range_crowded: half-size range used when a layout has three or more objects (space is tight).
        min_gap: minimum gap in pixels (max-norm) between object boxes, so same-colour shapes never merge.
        margin: minimum distance in pixels from an object box to the image border.
    """

    resolution: int
    shapes: tuple[str, ...]
    size_range: tuple[float, float]
    size_range_crowded: tuple[float, float]
    min_gap: float = 2.0
    margin: float = 1.0

    @property
    def name(self) -> str:
        return f"shapes{self.resolution}"


WORLDS: dict[int, World] = {
    32: World(32, ("circle", "square", "triangle", "cross"), (5.0, 6.5), (5.0, 5.75)),
    64: World(64, ALL_SHAPES, (8.0, 11.0), (8.0, 10.0), min_gap=3.0, margin=2.0),
}


def get_world(resolution: int) -> World:
    """Return the World for a resolution (32 or 64), with a clear error otherwise."""
    if resolution not in WORLDS:
        raise ValueError(f"shapes world resolution {resolution} is not supported; use one of {sorted(WORLDS)}")
    return WORLDS[resolution]


def plural(name: str) -> str:
    """GenEval's plural rule: '+es' if the word ends in 's', else '+s' ('cross' -> 'crosses')."""
    return name + ("es" if name.endswith("s") else "s")


def with_article(word_phrase: str) -> str:
    """GenEval's article rule: 'an' if the first letter is a vowel ('an orange circle')."""
    return ("an " if word_phrase[0] in "aeiou" else "a ") + word_phrase


def check_shape(name: str, world: World | None = None, where: str = "") -> None:
    """Raise a one-line error naming the valid shapes when `name` is unknown."""
    valid = world.shapes if world is not None else ALL_SHAPES
    if name not in valid:
        loc = f" ({where})" if where else ""
        raise ValueError(f"unknown shape '{name}'{loc}; valid shapes: {', '.join(valid)}")


def check_color(name: str, where: str = "") -> None:
    """Raise a one-line error naming the valid colours when `name` is unknown."""
    if name not in COLORS:
        loc = f" ({where})" if where else ""
        raise ValueError(f"unknown colour '{name}'{loc}; valid colours: {', '.join(COLOR_NAMES)}")
