"""Loaded at interpreter start where tests.helpers.full_disk.environment put this directory on
PYTHONPATH: the process's writes under the paths it names fill up."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_full_disk", Path(__file__).parent.parent / "full_disk.py")
_full_disk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_full_disk)
_full_disk.from_environment()
