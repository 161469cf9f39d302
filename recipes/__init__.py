"""Accelerate / DeepSpeed recipes for fine-tuning RoBERTa-style encoders on text classification.

`recipes/cls.py` is the recipe; the modules beside it each hold one concern (docs/layout.md lists them).
"""


class RecipeError(Exception):
    """Bad input from the user: printed once as one `error: ...` line, exit status 2, nothing written."""


def first_line(err) -> str:
    """The first line of an exception's message (its type's name where it has none): what a RecipeError quotes."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
