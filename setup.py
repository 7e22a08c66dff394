"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml): every package under
``arc_engine/``, and the top-level ``integrations/`` folder installed as ``arc_engine.integrations``."""

from setuptools import find_packages, setup

INTEGRATIONS = "arc_engine.integrations"

packages = find_packages(include=["arc_engine", "arc_engine.*"])
packages += [INTEGRATIONS, *(f"{INTEGRATIONS}.{name}" for name in find_packages("integrations"))]
setup(packages=packages, package_dir={INTEGRATIONS: "integrations"})
