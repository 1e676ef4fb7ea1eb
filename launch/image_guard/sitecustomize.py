"""The GPU image's missing packages, made missing here: loaded by every Python that the GPU kit's rehearsal starts
(launch/gpu_rehearse.py copies this file into the rehearsed machine's work dir, which gpu_check.sh puts on
PYTHONPATH, so Python imports it at start-up).

The image has no package registry and lacks what `launch/gpu_calls.json` lists under `image_lacks`; a stage of the
kit provides some of them (`setup` installs the carried wheels, `prompts` and `gguf` write stand-in packages under
the machine's work dir). Here every one of them would import from the CPU venv, so a stage that needs one before the
stage that provides it ran would pass here and fail there. So this module swaps the venv's site-packages on
sys.path for GPU_IMAGE_SITE, a folder of links to everything in it but those packages (and their metadata): to
`import`, `importlib.util.find_spec` and `importlib.metadata` they are absent, as on the image (libraries that
probe for an optional package behave as they would there). A package the `setup` stage provides comes back once
that stage installed it for the 3.12 target under $GPU_IMAGE_WORK/site-check (the venv's copy stands in: the
wheels are for Python 3.12); a stand-in a stage wrote under $GPU_IMAGE_WORK/pkgs is found on PYTHONPATH as usual.
Environment: GPU_IMAGE_SITE, GPU_IMAGE_REAL_SITE, GPU_IMAGE_LACKS (JSON: module -> providing stage or null),
GPU_IMAGE_WORK.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import sys


class SetupProvided(importlib.abc.MetaPathFinder):
    """Finds a package the `setup` stage provides, in the real site-packages, once that stage installed it."""

    def __init__(self, names: list[str], real_site: str, work: str):
        self.names, self.real_site, self.work = set(names), real_site, work

    def _installed(self, name: str) -> bool:
        return os.path.isdir(os.path.join(self.work, "site-check", name))

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in self.names or "." in fullname or not self._installed(top):
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.real_site])

    def find_distributions(self, context=None):
        context = context or importlib.metadata.DistributionFinder.Context()
        name = (context.name or "").replace("-", "_").lower()
        if name not in self.names or not self._installed(name):
            return iter(())
        return importlib.metadata.MetadataPathFinder.find_distributions(
            importlib.metadata.DistributionFinder.Context(name=context.name, path=[self.real_site]))


def install() -> None:
    site, real, lacks, work = (os.environ.get(k) for k in
                               ("GPU_IMAGE_SITE", "GPU_IMAGE_REAL_SITE", "GPU_IMAGE_LACKS", "GPU_IMAGE_WORK"))
    if not (site and real and lacks and work):
        return
    sys.path[:] = [site if os.path.realpath(p) == os.path.realpath(real) else p for p in sys.path]
    setup = [name for name, stage in json.loads(lacks).items() if stage == "setup"]
    sys.meta_path.insert(0, SetupProvided(setup, real, work))  # before PathFinder, as the bundle sits on PYTHONPATH


install()
