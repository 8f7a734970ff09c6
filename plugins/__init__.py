"""Built-in rrtod plugins. Each subpackage registers through the ``rrto`` entry-point group in
pyproject.toml, exactly as a third-party distribution would."""
