"""Package discovery for camp2p-overlap; everything else is in pyproject.toml.

Every package under ``camp2p_overlap/`` is found automatically. The patch
manifests live in the repository's top-level ``patches/`` folder (where a
reader looks for what is patched and why) and ship inside the wheel as the
package ``camp2p_overlap.patches``; discovery alone cannot map a folder
outside the package tree, so that one mapping is added here.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["camp2p_overlap", "camp2p_overlap.*"]), "camp2p_overlap.patches"],
    package_dir={"camp2p_overlap.patches": "patches"},
)
