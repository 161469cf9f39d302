"""What the model learns from: the data sources, columns, labels, tokenized splits, sampler and loaders (`data.py`),
the named tasks (`tasks.py`) and the problem type with its label encoding and loss (`problem.py`)."""
