"""Serving a trained classifier: ONNX export with its parity check (recipes/export.py) and batch prediction over
files of any size (recipes/predict.py); one module per concern."""
