"""The model-zoo compatibility corpus: third-party models and app idioms run locally and
offloaded, compared, and measured (``python -m compat``; docs/compatibility.md)."""
