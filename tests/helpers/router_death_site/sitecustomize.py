"""Loaded at interpreter start where tests.helpers.router_death.environment put this directory on
PYTHONPATH: the router process dies at the step it names."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_router_death", Path(__file__).parent.parent / "router_death.py")
_router_death = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_router_death)
_router_death.from_environment()
