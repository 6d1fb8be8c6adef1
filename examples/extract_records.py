"""Extract structured records from free text with a pydantic model, on the embedded model.

Each passage is turned into a `Contact` record: the model's output is constrained to the
model's JSON schema (`SamplingParams(structured_outputs={"json": Contact})`), so every
output parses and validates. Run from the repository root:

    python examples/extract_records.py [--backend xgrammar|outlines] [--stack examples/stacks/structured-output.yaml]
"""

from __future__ import annotations

import argparse
from typing import Literal

from pydantic import BaseModel, Field

from tandem import LLM, SamplingParams

PASSAGES = [
    "Hi, I'm Maria Lopez, 34, a nurse from Madrid. Reach me at maria.lopez@example.com.",
    "Our new intern, Tom Becker (22), studies physics in Berlin; email tom.b@example.org.",
    "Dr. Aiko Tanaka, 51, is a surgeon in Osaka. Her address is aiko@example.net.",
    "Contact Peter Novak, a 45-year-old carpenter living in Prague: peter@example.com.",
]


class Contact(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    job: str = Field(max_length=30)
    city: str = Field(max_length=30)
    email: str = Field(pattern=r"^[a-z.]+@[a-z]+\.(com|org|net)$")
    seniority: Literal["junior", "senior", "unknown"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["xgrammar", "outlines"], default=None)
    parser.add_argument("--stack", default=None, help="a stack YAML (default: built-in stack)")
    args = parser.parse_args()
    llm = LLM(config=args.stack)
    spec: dict = {"json": Contact}
    if args.backend:
        spec["backend"] = args.backend
    params = SamplingParams(temperature=0, max_tokens=96, structured_outputs=spec)
    conversations = [
        [
            {"role": "system", "content": "Extract the person in the text as a JSON record."},
            {"role": "user", "content": passage},
        ]
        for passage in PASSAGES
    ]
    try:
        for passage, output in zip(PASSAGES, llm.chat(conversations, params), strict=True):
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                print(f"error: {output.error}")
                continue
            record = Contact.model_validate_json(completion.text)  # always valid
            print(f"{passage}\n  -> {record!r}\n")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
