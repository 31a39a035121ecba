"""Write the CPU demo's edit prompts: ``digenrl/data/edits.jsonl`` (training) and
``digenrl/data/edits-test.jsonl`` (held out), with their 32 x 32 input images in
``digenrl/data/edits/``.

Each input image is a scene of the shapes world (:mod:`digenrl.data.shapes`), drawn from a
fixed seed; each prompt asks for the shape in another colour ("make the circle blue") and
carries the source and target captions as metadata. Deterministic: running it again writes the
same bytes (PNG without timestamps). ``python scripts/make_edit_demo.py`` from the repo root.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image

from digenrl.data.shapes import BACKGROUND_WORDS, COLOURS, render, sample_scene

DATA = Path(__file__).resolve().parents[1] / "digenrl" / "data"
TRAIN, TEST = 12, 4


def main() -> None:
    rng = random.Random(20240)
    (DATA / "edits").mkdir(exist_ok=True)
    lines = []
    for i in range(TRAIN + TEST):
        scene = sample_scene(rng)
        target = rng.choice([c for c in COLOURS if c not in (scene.colour, scene.background)])
        name = f"edits/{i:02d}.png"
        Image.fromarray(render(scene).permute(1, 2, 0).numpy()).save(DATA / name, optimize=True)
        lines.append(json.dumps({
            "prompt": f"make the {scene.shape} {target}", "image": name, "source": scene.prompt,
            "target": f"a {target} {scene.shape} on a {BACKGROUND_WORDS[scene.background]} background"}))
    (DATA / "edits.jsonl").write_text("".join(x + "\n" for x in lines[:TRAIN]))
    (DATA / "edits-test.jsonl").write_text("".join(x + "\n" for x in lines[TRAIN:]))


if __name__ == "__main__":
    main()
