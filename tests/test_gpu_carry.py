"""What a GPU call carries (docs/gpu.md): the wheels of ``scripts/gpu_wheels.sh`` cover every requirement of
revtrain and of the carried packages that the GPU image's own packages do not bring, so the report cannot stop on
an import the image lacks (cloudpickle and xxhash once would have).

Read from the installed distributions' metadata (``constraints.txt``'s versions, which the wheels are), for
CPython 3.12 on x86-64 Linux, extras followed as pip follows them."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import REPO

GPU_ENVIRONMENT = {
    "python_version": "3.12", "python_full_version": "3.12.1", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def _shell_list(name):
    """The names in ``NAME="..."`` of scripts/gpu_wheels.sh (the value may span lines)."""
    text = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    match = re.search(rf'^{name}="([^"]*)"', text, re.MULTILINE)
    assert match, f"{name} not in scripts/gpu_wheels.sh"
    return {canonicalize_name(word) for word in match.group(1).split()}


def _requirements(name, extras):
    """(name, extras) of each requirement of the installed distribution ``name`` that applies on the GPU image."""
    found = []
    for line in importlib.metadata.distribution(name).requires or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not any(
                requirement.marker.evaluate(dict(GPU_ENVIRONMENT, extra=extra)) for extra in ("", *extras)):
            continue
        found.append((canonicalize_name(requirement.name), tuple(sorted(requirement.extras))))
    return found


def _closure(names):
    """Every distribution that ``names`` need, themselves included."""
    seen, todo = set(), [(canonicalize_name(name), ()) for name in names]
    while todo:
        item = todo.pop()
        if item not in seen:
            seen.add(item)
            todo.extend(_requirements(*item))
    return {name for name, _ in seen}


def test_the_carried_wheels_cover_what_the_image_does_not_bring():
    image, carried = _shell_list("IMAGE_HAS"), _shell_list("PACKAGES") | _shell_list("DEPENDENCIES")
    not_carried = _shell_list("NOT_CARRIED")
    declared = {canonicalize_name(Requirement(line).name)
                for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert not_carried <= declared
    needed = _closure((declared - not_carried) | carried) - _closure(image)
    assert needed - carried == set(), "add to DEPENDENCIES (or PACKAGES) in scripts/gpu_wheels.sh"
    # the revtrain requirements the image lacks are carried by name, so gpu_report.sh's import check names them
    assert (declared - not_carried) - _closure(image) <= _shell_list("PACKAGES")
