"""The message of `auto` backend choice when every backend refused a constraint."""

from __future__ import annotations

from tandem.structured_output.backend import GrammarBackend


def combine_refusals(refusals: list[tuple[GrammarBackend, str]]) -> str:
    """One message for `auto` when every backend refused: `field: path: not enforced by
    A or B` when they refused the same keyword, else each backend's reason."""
    messages = [message for _, message in refusals]
    suffixes = [f"not enforced by {backend.label}" for backend, _ in refusals]
    heads = [m[: -len(s)] for m, s in zip(messages, suffixes, strict=True) if m.endswith(s)]
    if len(heads) == len(messages) and len(set(heads)) == 1:
        labels = " or ".join(backend.label for backend, _ in refusals)
        return f"{heads[0]}not enforced by {labels}"
    if len(set(messages)) == 1:
        return messages[0]
    return "no backend enforces it: " + "; ".join(
        f"{backend.label}: {message}" for backend, message in refusals
    )
