"""Where the Hydra configs are: inside the installed package (a wheel carries configs/ as
experiments/configs, see setup.py), or the checkout's top-level configs/ (an editable install, or
the tests run from the checkout)."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # experiments/
CONFIG_DIR = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
