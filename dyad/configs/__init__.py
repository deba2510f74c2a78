"""The configs dyad ships: `digits.yaml` is what `dyad train` runs without `--config`. A package
so that they install with dyad (`dyad.configs`), wheel installs included."""
