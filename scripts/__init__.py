"""Command-line tools around the recipe: offline model, config checker, memory model, benchmark."""
