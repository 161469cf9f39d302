"""Accelerate / DeepSpeed recipes for fine-tuning RoBERTa-style encoders on text classification.

`recipes/cls.py` is the recipe; beside it `config.py` (the flags) and `flag_checks.py` (their values), and one
package per concern: checks/, inputs/, model/, training/, checkpoints/, outputs/, metrics/, testing/
(docs/layout.md lists every file).
"""


class RecipeError(Exception):
    """Bad input from the user: printed once as one `error: ...` line, exit status 2, nothing written."""


def first_line(err) -> str:
    """The first line of an exception's message (its type's name where it has none): what a RecipeError quotes."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
