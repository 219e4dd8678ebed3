"""How the revtrain package is assembled (the metadata, dependencies and command are in pyproject.toml).

The gin configs ship inside the package, from the checkout's own files (no second copy): setuptools maps the
package ``revtrain.configs`` to the top-level ``configs/`` directory, and ``revtrain.configs.<name>`` to each
example of ``examples/<name>/`` (its gin files and Python modules), so a wheel holds
``revtrain/configs/*.gin`` and ``revtrain/configs/own_block/{train.gin,my_blocks.py}``. ``revtrain train
--config NAME.gin`` and ``include 'NAME.gin'`` find them there (`revtrain.ginconfig.shipped_config_dirs`).
"""

import pathlib

from setuptools import find_namespace_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").iterdir() if p.is_dir() and p.name.isidentifier())
CONFIG_PACKAGES = {"revtrain.configs": "configs", **{f"revtrain.configs.{n}": f"examples/{n}" for n in EXAMPLES}}

setup(
    packages=find_namespace_packages(include=["revtrain", "revtrain.*"], exclude=["revtrain.configs*"])
    + list(CONFIG_PACKAGES),
    package_dir=CONFIG_PACKAGES,
    package_data={name: ["*.gin"] for name in CONFIG_PACKAGES},
)
