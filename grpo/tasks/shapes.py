"""A visual task generated in code: what colour and shape is drawn? `red circle`, `blue square`...

Each sample is one image (PIL, RGB) of one filled shape (circle, square, triangle) in one colour
(red, green, blue) on a white ground, at a size and place drawn from the sample's own seed; images
are 56 x 56, 84 x 56 or 56 x 84 pixels, so a batch holds images of different token counts (with
patch 14 and merge 2: 4, 6 and 6 placeholder tokens). The prompt is the question, the answer the
two words; exact match. No download needed."""

from __future__ import annotations

import random

from grpo.errors import ConfigError
from grpo.tasks.base import Sample, Task, hold_out

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((56, 56), (84, 56), (56, 84))
PROMPT = "what is it?"


def draw(shape: str, colour: str, size: tuple[int, int], rng: random.Random):
    """One image: `shape` filled in `colour`, between 60% and 90% of the shorter side, placed at random."""
    from PIL import Image, ImageDraw  # local: PIL is heavy; grpo.config imports the task registry

    w, h = size
    image = Image.new("RGB", size, (255, 255, 255))
    side = int(min(w, h) * rng.uniform(0.6, 0.9))
    x, y = rng.randint(0, w - side), rng.randint(0, h - side)
    pen, fill = ImageDraw.Draw(image), COLOURS[colour]
    if shape == "circle":
        pen.ellipse([x, y, x + side, y + side], fill=fill)
    elif shape == "square":
        pen.rectangle([x, y, x + side, y + side], fill=fill)
    else:
        pen.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def build_shapes(cfg) -> Task:
    """`task.size` samples (default 2,048) from `task.seed`, `task.eval_size` held out."""
    count = cfg.size or 2048
    rng = random.Random(cfg.seed)
    samples = []
    for _ in range(count):
        shape, colour, size = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(SIZES)
        samples.append(Sample(prompt=PROMPT, answer=f"{colour} {shape}",
                              meta={"images": [draw(shape, colour, size, rng)]}))
    train, held_out = hold_out(samples, cfg.eval_size, cfg.seed, ConfigError)
    return Task("shapes", train=train, eval=held_out, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
