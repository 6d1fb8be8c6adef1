"""Build benchmarks/workloads/spec_repetitive.json: prompts that ask SmolLM2 to repeat or
rewrite a given passage (the n-gram drafter's home ground), tokenised with the embedded
model's tokenizer, 256 output tokens each (greedy, ignore_eos).

Run: python benchmarks/make_spec_workload.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PASSAGES = [
    "The old lighthouse stood on the rocky cliff above the harbour, as it had for more than "
    "two hundred years. Every evening the keeper climbed the one hundred and twelve steps of "
    "the spiral stair, trimmed the wick, filled the reservoir with oil and polished the great "
    "lens until it shone. When the fog rolled in from the sea he wound the clockwork that "
    "turned the light and sounded the horn every thirty seconds, so that the fishing boats "
    "could find their way home. In the morning he wrote in the log the time the light was "
    "lit, the state of the weather and the names of the ships that had passed, and then he "
    "slept until noon. The village below depended on him, and he never once failed them.",
    "To make bread at home you need flour, water, salt and yeast. Mix the flour and the salt "
    "in a large bowl, dissolve the yeast in warm water and pour it into the flour. Stir until "
    "a rough dough forms, then knead it on a floured table for ten minutes, until it is "
    "smooth and elastic. Put the dough back in the bowl, cover it with a damp cloth and let "
    "it rise in a warm place for about an hour, until it has doubled in size. Shape it into "
    "a loaf, place it on a baking tray and let it rise again for thirty minutes. Bake it in "
    "a hot oven for forty minutes, until the crust is golden and the loaf sounds hollow when "
    "you tap the bottom. Let it cool before you cut it.",
    "The train left the city at seven in the morning and followed the river north through "
    "the valley. For the first hour the passengers saw factories, warehouses and the backs "
    "of houses, and then the fields opened up on both sides of the line. Cows grazed beside "
    "the water, and farmers were already at work in the orchards. At the market town the "
    "train stopped for ten minutes, and a woman with a basket sold coffee and warm rolls "
    "through the windows. After the town the line began to climb into the hills, crossing "
    "the river three times on narrow iron bridges, until at last it reached the station at "
    "the head of the valley, where the snow still lay on the mountains in the middle of May.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. "
    "In the leaves, a pigment called chlorophyll absorbs sunlight, mostly in the red and "
    "blue parts of the spectrum. The plant takes in carbon dioxide from the air through "
    "small openings called stomata and draws water up from the soil through its roots. "
    "Using the energy of the absorbed light, it splits the water molecules, releasing "
    "oxygen into the air, and combines the hydrogen with carbon dioxide to build sugars. "
    "These sugars feed the plant and are stored as starch in its roots, stems and seeds. "
    "Almost all life on Earth depends on this process, directly or indirectly, for its food "
    "and for the oxygen it breathes.",
]
TEMPLATES = [
    "Repeat the following passage word for word.\nPassage: {p}\nRepeated passage: ",
    "Here is a text: {p}\nHere is the same text again, copied exactly: ",
    "Rewrite the following passage without changing a word.\nText: {p}\nRewritten text: ",
    "Copy this paragraph.\nParagraph: {p}\nCopy: ",
]
MAX_TOKENS = 256


def main() -> None:
    from tandem.models.model_files import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir("default"))
    requests = []
    for t, template in enumerate(TEMPLATES):
        for i in range(len(PASSAGES)):
            text = template.format(p=PASSAGES[(i + t) % len(PASSAGES)])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            requests.append({"prompt": text, "prompt_token_ids": ids, "max_tokens": MAX_TOKENS})
    out = ROOT / "benchmarks" / "workloads" / "spec_repetitive.json"
    out.write_text(json.dumps({"name": "spec_repetitive", "requests": requests}))
    print(out, len(requests), "requests")


if __name__ == "__main__":
    main()
